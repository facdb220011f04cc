"""`token_count(text, tokenizer_name)`: tokens in `text` under a registered tokenizer.

Backed by the tokenizer catalogue (udfs/tokenizer_catalogue.py): `tokenizer_name` is a name
given to `udfs.tokenizer_catalogue.register(name, path)`, e.g. the source topic's name, or
the built-in `whitespace`. Returns INT; NULL when `text` or `tokenizer_name` is NULL. An
unknown name fails the query with a message naming the catalogue file and the known names
(a silent NULL would hide a missing registration).

    SELECT model_id, token_count(completion, 'streamtune.feedback') AS tokens FROM feedback;

>>> count_tokens("a b  c", "whitespace")
3
>>> count_tokens(None, "whitespace") is None
True
"""

from __future__ import annotations

from pyflink.table import DataTypes
from pyflink.table.udf import udf

from udfs import tokenizer_catalogue


def count_tokens(text: str | None, tokenizer_name: str | None) -> int | None:
    if text is None or tokenizer_name is None:
        return None
    return tokenizer_catalogue.count(text, tokenizer_name)


token_count = udf(count_tokens, input_types=[DataTypes.STRING(), DataTypes.STRING()],
                  result_type=DataTypes.INT(), name="token_count")
