"""The tokenizer catalogue (udfs/tokenizer_catalogue.py) and token_count (udfs/token_count.py), in Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from udfs import tokenizer_catalogue as catalogue
from udfs.token_count import count_tokens

pytestmark = pytest.mark.sql

REPO = Path(__file__).resolve().parents[1]
VOCAB = {"[UNK]": 0, "hello": 1, "world": 2, "x": 3, "=": 4, "1": 5, "2": 6}


def word_level():
    """A tiny word-level tokenizer: one token per whitespace/punctuation-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    return tok


@pytest.fixture
def catalogue_dir(tmp_path, monkeypatch):
    d = tmp_path / "catalogue"
    monkeypatch.setenv("STREAMTUNE_TOKENIZER_CATALOGUE", str(d))
    monkeypatch.setattr(catalogue, "RECHECK_SECONDS", 0.0)
    return d


def test_whitespace_is_built_in(catalogue_dir):
    assert catalogue.count("  two \n words ", "whitespace") == 2
    assert catalogue.count("", "whitespace") == 0
    assert "whitespace" in catalogue.names()
    assert not (catalogue_dir / "catalogue.json").exists()


def test_register_a_tokenizer_json_file(catalogue_dir, tmp_path):
    path = tmp_path / "wl" / "tokenizer.json"
    path.parent.mkdir()
    word_level().save(str(path))
    assert catalogue.register("topic.a", path) == str(path)
    assert json.loads((catalogue_dir / "catalogue.json").read_text()) == {"topic.a": str(path)}
    assert catalogue.count("hello world x=12", "topic.a") == 6  # hello world x = 1 2
    assert count_tokens("hello world", "topic.a") == 2


def test_register_an_hf_directory_and_special_tokens_are_not_counted(catalogue_dir, tmp_path):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = word_level()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")
    hf.save_pretrained(tmp_path / "hf")
    catalogue.register("hf-dir", tmp_path / "hf")
    expected = len(hf("hello world 12", add_special_tokens=False)["input_ids"])
    assert expected == 4 and len(hf("hello world 12")["input_ids"]) == 5
    assert catalogue.count("hello world 12", "hf-dir") == expected


def test_register_a_tokenizer_object_saves_it_into_the_catalogue(catalogue_dir):
    stored = catalogue.register("obj", word_level())
    assert Path(stored).is_relative_to(catalogue_dir / "store")
    assert catalogue.count("hello x", "obj") == 2


def test_copy_puts_the_tokenizer_into_the_catalogue_store(catalogue_dir, tmp_path):
    import shutil

    src = tmp_path / "hf"
    src.mkdir()
    word_level().save(str(src / "tokenizer.json"))
    stored = catalogue.register("copied", src, copy=True)
    assert Path(stored) == catalogue_dir / "store" / "copied"
    shutil.rmtree(src)  # workers that see only the catalogue directory still load it
    assert catalogue.count("hello world", "copied") == 2
    single = tmp_path / "single.json"
    word_level().save(str(single))
    assert catalogue.register("copied-file", single, copy=True) == str(catalogue_dir / "store" / "copied-file" / "tokenizer.json")


def test_unknown_name_raises_with_the_known_names(catalogue_dir):
    with pytest.raises(LookupError, match="unknown tokenizer 'nope'.*whitespace"):
        catalogue.count("a", "nope")
    with pytest.raises(LookupError):
        count_tokens("a", "nope")
    assert count_tokens(None, "nope") is None and count_tokens("a", None) is None


def test_bad_registrations_are_refused(catalogue_dir, tmp_path):
    with pytest.raises(ValueError):
        catalogue.register("bad name", tmp_path)
    with pytest.raises(ValueError):
        catalogue.register("whitespace", tmp_path)
    with pytest.raises(FileNotFoundError):
        catalogue.register("missing", tmp_path / "nothing-here")
    with pytest.raises(TypeError):
        catalogue.register("num", 42)
    assert catalogue.registered() == {}


def test_re_registration_and_unregister_are_seen_by_a_reader(catalogue_dir, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    word_level().save(str(a))
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    chars.save(str(b))
    catalogue.register("t", a)
    assert catalogue.count("hello world", "t") == 2
    # another process (a Python UDF worker) changes the catalogue file
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "udfs.tokenizer_catalogue", "register", "t", str(b)], env=env, check=True,
                   cwd=REPO, capture_output=True)
    assert catalogue.count("hello world", "t") == len("hello world")
    subprocess.run([sys.executable, "-m", "udfs.tokenizer_catalogue", "unregister", "t"], env=env, check=True, cwd=REPO)
    with pytest.raises(LookupError):
        catalogue.count("hello", "t")


def test_a_worker_process_sees_a_client_registration(catalogue_dir, tmp_path):
    path = tmp_path / "wl.json"
    word_level().save(str(path))
    catalogue.register("from-client", path)
    code = "from udfs.token_count import count_tokens; print(count_tokens('hello world x', 'from-client'))"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "3"


def test_default_catalogue_dir_is_under_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("STREAMTUNE_TOKENIZER_CATALOGUE", raising=False)
    monkeypatch.setenv("STREAMTUNE_DATA_DIR", str(tmp_path / "data"))
    assert catalogue.catalogue_dir() == (tmp_path / "data" / "tokenizers").resolve()

