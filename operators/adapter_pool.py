"""Many LoRA adapters on one shared base for inference, swapped in memory between requests.

The pool preallocates `slots` PEFT adapters of the largest rank it accepts on fixed target
modules. Loading a version copies its tensors into a slot (zero-padded to the slot's rank,
with the version's own scaling): no allocation, no model surgery, no disk. Every request and
every copy holds the pool's lock, so a request sees one whole version, never half of one.

Requests decode in batches (operators.batched_decoding): `scheduler()` gives the thread that
gathers concurrent requests for a few ms and decodes them in one loop, each row with its own
version's slot (PEFT's mixed-adapter batch), under the lock; `generate` decodes one alone.

With the version's sha256, `put` first checks every file against the artifact's manifest
(connectors/artifact_store.verify_artifact): what the slots hold is what was recorded, config
included, and a changed, missing or unlisted file is refused by name.

Versions are immutable names: slots and the CPU cache are keyed by `version_key`
("<model_id>/<mlflow_version>"), never by model_id. The hot versions sit in slots (device
memory), up to `cpu_cache` more in CPU memory as tensors, both least-recently used first
out; a version in neither is loaded again by whoever holds its files (the follower).

    pool = AdapterPool("/models/tiny-llama", slots=8)
    pool.put("bot/3", files, sha256)          # verify, parse + check once, into the CPU cache
    pool.generate("bot/3", "x=1;y=", 4)       # swaps into a slot if it is not in one, greedy
"""

from __future__ import annotations

import contextlib
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
from operators.batched_decoding import BatchScheduler, Row, RowResult, SamplingParams, decode_batch

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
    finish_reason: str = "stop"   # "stop": eos or a stop string; "length": max_tokens
    prompt_tokens: int = 0


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
        eos = base.generation_config.eos_token_id if base.generation_config is not None else None
        self.eos_ids = {e for e in ([eos] if isinstance(eos, int) else list(eos or [])) + [self.tokenizer.eos_token_id]
                        if e is not None}
        # Peft module name as saved in artifacts ("base_model.model.<path>") -> LoRA layer.
        self._layers = {n: m for n, m in self.model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
        # Held by every request and every copy; callers may hold it around a route lookup too.
        self.lock = threading.RLock()
        self._slot_of: OrderedDict[str, str] = OrderedDict()   # version_key -> slot name, LRU first
        self._cpu: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self.swaps = 0
        self.last_swap_seconds = 0.0
        self._stack_slots()
        for name in self.slot_names:
            self._clear_slot(name)

    @torch.no_grad()
    def _stack_slots(self) -> None:
        """Each layer's slot tensors become views of one stack [slots + 1, ...] (the last
        entry: zeros, for rows of the base), and each slot's scaling one entry of a vector:
        a mixed batch gathers every row's own slot with one batched matmul per layer
        (`mixed_batch`), however many versions it holds."""
        self.slot_index = {name: i for i, name in enumerate(self.slot_names)}
        self.slot_scaling = torch.zeros(len(self.slot_names) + 1, device=self.device)
        self._stacks: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
        for layer in self._layers.values():
            a0, b0 = layer.lora_A[self.slot_names[0]].weight, layer.lora_B[self.slot_names[0]].weight
            a_stack = torch.zeros((len(self.slot_names) + 1, *a0.shape), dtype=a0.dtype, device=a0.device)
            b_stack = torch.zeros((len(self.slot_names) + 1, *b0.shape), dtype=b0.dtype, device=b0.device)
            for i, slot in enumerate(self.slot_names):
                layer.lora_A[slot].weight.data = a_stack[i]
                layer.lora_B[slot].weight.data = b_stack[i]
            self._stacks.append((layer, a_stack, b_stack))

    @contextlib.contextmanager
    def mixed_batch(self, adapters: list[str | None]):
        """While decoding a batch whose rows use different slots (None: the base): the LoRA
        layers give the base's output plus, per row, x·Aᵀ·Bᵀ·scaling of that row's slot,
        gathered from the stacks (one bmm pair per layer, not one pass per version as peft's
        `adapter_names` does). Call with `lock` held."""
        idx = torch.tensor([len(self.slot_names) if a is None else self.slot_index[a] for a in adapters],
                           device=self.device)
        scale = self.slot_scaling.index_select(0, idx)[:, None, None]

        def hook_for(a_stack: torch.Tensor, b_stack: torch.Tensor):
            def hook(module, args, output):
                x = args[0]
                a, b = a_stack.index_select(0, idx), b_stack.index_select(0, idx)
                h = torch.bmm(x.to(a.dtype), a.transpose(1, 2))
                return output + (torch.bmm(h, b.transpose(1, 2)) * scale).to(output.dtype)
            return hook

        handles = []
        with self.model.disable_adapter():
            try:
                for layer, a_stack, b_stack in self._stacks:
                    handles.append(layer.register_forward_hook(hook_for(a_stack, b_stack)))
                yield
            finally:
                for h in handles:
                    h.remove()

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
        self.slot_scaling[self.slot_index[slot]] = loaded.scaling
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _clear_slot(self, slot: str) -> None:
        for layer in self._layers.values():
            layer.lora_A[slot].weight.zero_()
            layer.lora_B[slot].weight.zero_()

    # -- inference ----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids, as every generation sees them (ValueError: none)."""
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        return list(ids)

    def generate(self, version_key: str, prompt: str, max_tokens: int = 16,
                 params: SamplingParams | None = None) -> Generation:
        """Completion of `prompt` by one version (BASE: no adapter), greedy unless `params`
        say otherwise; alone, synchronously (batched requests: `scheduler`)."""
        params = params or SamplingParams(max_tokens=max_tokens)
        row = Row(self.tokenize(prompt), params)
        with self.lock:
            slot = self.activate(version_key)
            result = decode_batch(self.model, self.tokenizer, [row], [slot], self.device, self.eos_ids,
                                  self.mixed_batch)[0]
        return generation_of(result, version_key)

    def scheduler(self, window_ms: float = 5.0, max_batch: int = 16, on_batch=None,
                  max_wait_ms: float = 50.0) -> BatchScheduler:
        """A batch scheduler over this pool (operators.batched_decoding): concurrent requests,
        for one or several versions, decoded together."""
        return BatchScheduler(self, window_ms=window_ms, max_batch=max_batch, on_batch=on_batch,
                              max_wait_ms=max_wait_ms)


def generation_of(result: RowResult, version_key: str) -> Generation:
    return Generation(result.text, result.mean_logprob, result.tokens, version_key, result.finish_reason,
                      result.prompt_tokens)
