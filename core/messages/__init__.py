"""One pydantic model per wire message; producers build them, consumers parse them.

| message                  | topic (default)              | producer                       | module        |
|--------------------------|------------------------------|--------------------------------|---------------|
| FeedbackSample           | streamtune.feedback          | apps, API, CDC mapping          | feedback      |
| FinetuneSpec             | streamtune.configs           | API, users                      | spec          |
| RetrainTrigger           | streamtune.configs           | SQL, CDC trigger rules          | trigger       |
| VersionRecord            | streamtune.versions          | the trainer (exactly-once)      | version       |
| DeadLetter               | streamtune.dlq               | validation, trainer, CDC        | dead_letter   |
| AdapterVersionBroadcast  | streamtune.adapter-versions  | the registrar                   | broadcast     |
| ChangeEnvelope           | streamtune.cdc.<name>        | `streamtune cdc`, Debezium      | change        |
| InferenceRecord          | streamtune.inference-log     | `streamtune serve`              | inference     |
| AliasMove                | streamtune.alias-moves       | API, rollback guard             | alias_move    |
| ReviewRecord             | streamtune.review            | pseudo-labels (below threshold) | review        |

`sql/ddl.sql` declares the same fields as Flink SQL tables (tests/test_contracts.py checks it).
"""

from core.messages.alias_move import AliasMove
from core.messages.base import MODEL_ID, Message, decode, describe_error, is_model_id
from core.messages.broadcast import AdapterVersionBroadcast
from core.messages.change import ChangeEnvelope, ChangeOrigin, ChangeSource, Retraction
from core.messages.dead_letter import DeadLetter, SourcePosition
from core.messages.feedback import FeedbackSample
from core.messages.inference import InferenceRecord
from core.messages.review import ReviewRecord
from core.messages.spec import (AdapterConfig, AdaptiveGranularity, EvaluationConfig, EwcConfig, FinetuneSpec, PseudoLabelConfig, ReplayConfig,
                                 RetentionPolicy, TrainingConfig, TriggerPolicy)
from core.messages.trigger import RetrainTrigger
from core.messages.version import (EvalScore, EvalSetResult, GateDecision, GranularityDecision, Lineage, OffsetRange, VersionMetrics,
                                  VersionRecord)

__all__ = ["AliasMove", "MODEL_ID", "Message", "decode", "describe_error", "is_model_id", "AdapterVersionBroadcast", "ChangeEnvelope",
           "ChangeOrigin", "ChangeSource", "Retraction", "DeadLetter", "SourcePosition", "FeedbackSample", "InferenceRecord",
           "AdapterConfig", "AdaptiveGranularity", "EvaluationConfig", "EwcConfig", "FinetuneSpec", "PseudoLabelConfig", "ReplayConfig", "RetentionPolicy", "ReviewRecord", "TrainingConfig", "TriggerPolicy", "RetrainTrigger", "Lineage",
           "OffsetRange", "VersionMetrics", "VersionRecord", "EvalScore", "EvalSetResult", "GateDecision", "GranularityDecision"]
