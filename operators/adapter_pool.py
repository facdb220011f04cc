"""Many LoRA adapters on one shared base for inference, swapped in memory between requests.

The pool preallocates `slots` PEFT adapters of the largest rank it accepts on fixed target
modules. Loading a version copies its tensors into a slot (zero-padded to the slot's rank,
with the version's own scaling): no allocation, no model surgery, no disk. Every request and
every copy holds the pool's lock, so a request sees one whole version, never half of one.

With the version's sha256, `put` first checks every file against the artifact's manifest
(connectors/artifact_store.verify_artifact): what the slots hold is what was recorded, config
included, and a changed, missing or unlisted file is refused by name.

Versions are immutable names: slots and the CPU cache are keyed by `version_key`
("<model_id>/<mlflow_version>"), never by model_id. The hot versions sit in slots (device
memory), up to `cpu_cache` more in CPU memory as tensors, both least-recently used first
out; a version in neither is loaded again by whoever holds its files (the follower).

    pool = AdapterPool("/models/tiny-llama", slots=8)
    pool.put("bot/3", files, sha256)          # verify, parse + check once, into the CPU cache
    pool.generate("bot/3", "x=1;y=", 4)       # swaps into a slot if it is not in one
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from core.errors import ArtifactIntegrityError
from core.routing import BASE

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoadedAdapter:
    """A version's tensors in CPU memory, keyed like the slot modules, with its scaling."""

    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])
    rank: int
    scaling: float
    nbytes: int


@dataclass(frozen=True)
class Generation:
    text: str
    mean_logprob: float   # mean log-probability of the generated tokens
    tokens: int
    version_key: str


def base_fingerprint(base_dir: Path) -> str:
    """A short id of the base model's files (config and weight names and sizes), for audits."""
    h = hashlib.sha256((base_dir / "config.json").read_bytes())
    for f in sorted(base_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def parse_adapter(files: dict[str, bytes], max_rank: int, targets: tuple[str, ...]) -> LoadedAdapter:
    """A PEFT artifact (adapter_config.json + adapter_model.safetensors) as slot tensors.

    Raises ArtifactIntegrityError for an artifact the slots cannot hold exactly.
    """
    try:
        config = json.loads(files["adapter_config.json"])
        state = load_safetensors(files["adapter_model.safetensors"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise ArtifactIntegrityError(f"unreadable adapter artifact: {e}") from None
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
    if not 0 < rank <= max_rank:
        raise ArtifactIntegrityError(f"adapter rank {rank} does not fit the serving slots (max rank {max_rank})")
    if config.get("use_dora") or config.get("bias", "none") != "none":
        raise ArtifactIntegrityError("adapters with DoRA or trained biases are not served by slot swapping")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        if module.rsplit(".", 1)[-1] not in targets:
            raise ArtifactIntegrityError(f"adapter targets {module}, outside the serving slots' {list(targets)}")
        b = state.get(f"{module}.lora_B.weight")
        if b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise ArtifactIntegrityError(f"adapter tensors of {module} do not match rank {rank}")
        tensors[module] = (a.float().contiguous(), b.float().contiguous())
    if not tensors:
        raise ArtifactIntegrityError("adapter artifact holds no LoRA tensors")
    nbytes = sum(a.numel() * 4 + b.numel() * 4 for a, b in tensors.values())
    return LoadedAdapter(tensors, rank, scaling, nbytes)


class AdapterPool:
    def __init__(self, base_dir: str | Path, slots: int = 8, cpu_cache: int = 1024, max_rank: int = 16,
                 targets: tuple[str, ...] = DEFAULT_TARGETS, device: str | None = None):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if slots < 1:
            raise ValueError("an adapter pool needs at least one slot")
        self.base_dir = str(Path(base_dir).resolve())
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir, local_files_only=True)
        base = AutoModelForCausalLM.from_pretrained(self.base_dir, local_files_only=True).to(self.device).eval()
        self.max_rank, self.targets, self.cpu_cache_size = max_rank, tuple(targets), cpu_cache
        self.base_fingerprint = base_fingerprint(Path(self.base_dir))
        config = LoraConfig(r=max_rank, lora_alpha=max_rank, target_modules=list(targets), lora_dropout=0.0,
                            bias="none", task_type="CAUSAL_LM", inference_mode=True)
        self.slot_names = [f"slot{i}" for i in range(slots)]
        self.model = get_peft_model(base, config, adapter_name=self.slot_names[0])
        for name in self.slot_names[1:]:
            self.model.add_adapter(name, config)
        self.model.eval()
        # Peft module name as saved in artifacts ("base_model.model.<path>") -> LoRA layer.
        self._layers = {n: m for n, m in self.model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
        # Held by every request and every copy; callers may hold it around a route lookup too.
        self.lock = threading.RLock()
        self._slot_of: OrderedDict[str, str] = OrderedDict()   # version_key -> slot name, LRU first
        self._cpu: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self.swaps = 0
        self.last_swap_seconds = 0.0
        for name in self.slot_names:
            self._clear_slot(name)

    # -- versions -----------------------------------------------------------------------
    def put(self, version_key: str, files: dict[str, bytes], sha256: str | None = None) -> LoadedAdapter:
        """Parse and check a version's artifact into the CPU cache (outside any request); with
        `sha256` (the version record's), its files are verified against their manifest first."""
        if sha256 is not None:
            from connectors.artifact_store import verify_artifact

            files = verify_artifact(files, sha256, version_key)
        loaded = parse_adapter(files, self.max_rank, self.targets)
        missing = [m for m in loaded.tensors if m not in self._layers]
        if missing:
            raise ArtifactIntegrityError(f"adapter modules not in the served base model: {missing[:3]}")
        with self.lock:
            self._cpu[version_key] = loaded
            self._cpu.move_to_end(version_key)
            for key in list(self._cpu):  # least recently used first; hot versions stay
                if len(self._cpu) <= self.cpu_cache_size:
                    break
                if key not in self._slot_of:
                    del self._cpu[key]
        return loaded

    def has(self, version_key: str) -> bool:
        with self.lock:
            return version_key == BASE or version_key in self._cpu

    def hot(self) -> list[str]:
        with self.lock:
            return list(self._slot_of)

    def activate(self, version_key: str) -> str | None:
        """Make `version_key` the active adapter, copying it into a slot if need be.

        Call with `lock` held (as `generate` does). Returns the slot, None for the base.
        """
        if version_key == BASE:
            return None
        slot = self._slot_of.get(version_key)
        if slot is not None:
            self._slot_of.move_to_end(version_key)
            return slot
        loaded = self._cpu.get(version_key)
        if loaded is None:
            raise KeyError(version_key)
        self._cpu.move_to_end(version_key)
        if len(self._slot_of) < len(self.slot_names):
            slot = next(s for s in self.slot_names if s not in self._slot_of.values())
        else:
            _, slot = self._slot_of.popitem(last=False)
        started = time.perf_counter()
        self._copy_into(slot, loaded)
        self.last_swap_seconds = time.perf_counter() - started
        self.swaps += 1
        self._slot_of[version_key] = slot
        return slot

    @torch.no_grad()
    def _copy_into(self, slot: str, loaded: LoadedAdapter) -> None:
        for name, layer in self._layers.items():
            a_weight, b_weight = layer.lora_A[slot].weight, layer.lora_B[slot].weight
            pair = loaded.tensors.get(name)
            if pair is None:
                a_weight.zero_()
                b_weight.zero_()
                continue
            a, b = pair
            a_weight[: loaded.rank].copy_(a, non_blocking=True)
            a_weight[loaded.rank:].zero_()
            b_weight[:, : loaded.rank].copy_(b, non_blocking=True)
            b_weight[:, loaded.rank:].zero_()
            layer.scaling[slot] = loaded.scaling
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _clear_slot(self, slot: str) -> None:
        for layer in self._layers.values():
            layer.lora_A[slot].weight.zero_()
            layer.lora_B[slot].weight.zero_()

    # -- inference ----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, version_key: str, prompt: str, max_tokens: int = 16) -> Generation:
        """Greedy completion of `prompt` by one version (BASE: no adapter)."""
        with self.lock:
            slot = self.activate(version_key)
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"].to(self.device)
            if slot is None:
                with self.model.disable_adapter():
                    out = self._greedy(ids, max_tokens)
            else:
                self.model.set_adapter(slot)
                out = self._greedy(ids, max_tokens)
        new_ids, logprobs = out
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        mean = sum(logprobs) / len(logprobs) if logprobs else 0.0
        return Generation(text, round(mean, 6), len(new_ids), version_key)

    def _greedy(self, ids: torch.Tensor, max_tokens: int) -> tuple[list[int], list[float]]:
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=self.tokenizer.pad_token_id)
        chosen = out.sequences[0, ids.shape[1]:].tolist()
        # The end token's log-probability counts too: stopping is a choice of the model.
        logprobs = [float(torch.log_softmax(score[0].float(), dim=-1)[token]) for score, token in zip(out.scores, chosen)]
        eos = self.tokenizer.eos_token_id
        return [t for t in chosen if t not in (eos, self.tokenizer.pad_token_id)], logprobs
