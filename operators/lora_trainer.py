"""LoRA steps for many models on one shared base, with state that round-trips as bytes.

The base model loads once per worker (cached by directory); each model_id gets its own
PEFT adapter on it. A step takes the adapter's saved state (or None for a fresh one), a
window's samples and a seed, and returns the new state, the PEFT-format artifact and the
metrics. Given the same state, samples and seed, a step is bitwise reproducible on CPU,
which is what makes a replay after a crash produce the same version.

    trainer = LoraTrainer.for_base("/models/tiny-llama")
    result = trainer.step("m1", spec.adapter_config, spec.training, None, samples, seed=7)
    result.files["adapter_model.safetensors"]  # bytes, identical on replay
    result.sha256  # the version's address: sha256 of the manifest of all its files (connectors/artifact_store.py)
    trainer.evaluate("m1", spec.adapter_config, spec.training, eval_samples)       # the live adapter
    trainer.evaluate("m1", champion_adapter, spec.training, eval_samples, champion_lora)  # saved weights

`replay` samples (operators/quality.py) train beside the window's own; the losses in the
metrics stay those of the window's samples. Gradient accumulation (`flush_every`
micro-batches per optimizer step) normalises each micro-batch by the weight of its whole
accumulation group, so it gives the update of one batch `flush_every` times the size.
With `ewc` (online EWC), each optimizer step also pays (strength/2)·Σ F·(θ − θ_prev)², θ_prev
the adapter after the previous step and F a running empirical Fisher (squared micro-batch
gradients of each window, older estimates decayed); both travel in the state.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from connectors.artifact_store import artifact_sha256, with_manifest
from core.messages import AdapterConfig, EwcConfig, TrainingConfig
from core.batching import collate, encode_example

_BASES: dict[str, "LoraTrainer"] = {}
_BASES_LOCK = threading.Lock()


@dataclass
class StepResult:
    state: dict          # {"shape": str, "lora": bytes, "optim": bytes, "steps": int, "sha256": str (of "lora")}
    files: dict          # PEFT artifact: file name -> bytes (manifest.json among them)
    sha256: str          # the artifact's address: of its manifest, which covers every file (config and weights)
    fresh_adapter: bool
    metrics: dict
    # With measure_noise: the micro-batch gradient norms (operators/granularity.py NoiseSample), or
    # None when the step had fewer than two micro-batches.
    noise: object = None


_GPU_SLOT = 0  # which of the visible GPUs this worker trains on (place_on_gpu)


def place_on_gpu(subtask_index: int) -> None:
    """Trainers created from now on in this worker use GPU `subtask_index` mod the GPUs it sees.

    The TaskManager declares its GPUs through Flink's external-resource framework, and Flink
    schedules slots by them; PyFlink gives Python functions no access to a slot's resource
    info (RuntimeContext.getExternalResourceInfos is Java-only), so the subtask index picks
    one, as Flink's own GPU example does. With one slot per GPU, one trainer per GPU.
    """
    global _GPU_SLOT
    _GPU_SLOT = subtask_index


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", _GPU_SLOT % torch.cuda.device_count())


class LoraTrainer:
    def __init__(self, base_dir: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base_dir = str(Path(base_dir).resolve())
        self.device = _device()
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir, local_files_only=True)
        self.base = AutoModelForCausalLM.from_pretrained(self.base_dir, local_files_only=True).to(self.device)
        self.base.requires_grad_(False)
        self.model = None  # the PeftModel wrapping `base`, created with the first adapter
        # Adapters held in the model (device memory), least recently used first. Beyond
        # `max_live_adapters` the oldest leaves; its next step loads it from keyed state.
        self.max_live_adapters = 64
        self._recent: OrderedDict[str, None] = OrderedDict()
        # adapter name -> (sha256 of the state it holds, its optimizer): skips reloading
        # keyed state that this worker itself produced at the previous step.
        self._live: dict[str, tuple[str, torch.optim.Optimizer]] = {}
        # Subtasks of one job share this process in Flink's loopback mode (mini-cluster):
        # one step at a time keeps the shared base, active adapter and torch's seed theirs.
        self._lock = threading.Lock()

    @classmethod
    def for_base(cls, base_dir: str, max_live_adapters: int | None = None) -> "LoraTrainer":
        """One trainer (one copy of the base weights) per base directory and worker."""
        key = str(Path(base_dir).resolve())
        with _BASES_LOCK:
            trainer = cls._load(key)
        if max_live_adapters is not None:
            trainer.max_live_adapters = max_live_adapters
        return trainer

    @classmethod
    def live_totals(cls) -> dict:
        """live_adapters() summed over this worker's trainers (the job's gauges)."""
        with _BASES_LOCK:
            lives = [t.live_adapters() for t in _BASES.values()]
        return {"adapters": sum(x["adapters"] for x in lives), "bytes": sum(x["bytes"] for x in lives)}

    @classmethod
    def _load(cls, key: str) -> "LoraTrainer":
        if key not in _BASES:
            if not Path(key, "config.json").exists():
                raise FileNotFoundError(f"base model directory {key} has no config.json "
                                        "(streamtune loads local HF-format directories only)")
            _BASES[key] = cls(key)
        return _BASES[key]

    # -- adapters -----------------------------------------------------------------------
    def _activate(self, model_id: str, adapter: AdapterConfig,
                  role: str = "m") -> tuple[str, list[tuple[str, torch.nn.Parameter]]]:
        """The adapter slot of `model_id` ("m": the one it trains; "c": where a champion is scored)."""
        from peft import LoraConfig, get_peft_model

        name = role + hashlib.sha1(f"{model_id}|{adapter.model_dump_json()}".encode()).hexdigest()[:12]
        config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                            target_modules=list(adapter.target_modules), task_type="CAUSAL_LM", bias="none")
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=name)
        elif name not in self.model.peft_config:
            self._evict(keep=self.max_live_adapters - 1)
            self.model.add_adapter(name, config)
        self.model.set_adapter(name)
        self._recent[name] = None
        self._recent.move_to_end(name)
        marker = f".{name}."
        params = sorted(((n, p) for n, p in self.model.named_parameters() if marker in n), key=lambda x: x[0])
        for _, p in params:
            p.requires_grad_(True)
        return name, params

    def _evict(self, keep: int) -> None:
        """Drop the least recently used adapters (and their optimizers) down to `keep`."""
        while len(self._recent) > max(keep, 1):
            name, _ = self._recent.popitem(last=False)
            self.model.delete_adapter(name)
            self._live.pop(name, None)

    def live_adapters(self) -> dict:
        """{"adapters", "bytes"}: the adapters held in the model, with their optimizer state."""
        tensors = [p for n, p in self.model.named_parameters() if "lora_" in n] if self.model else []
        moments = [t for _, optimizer in self._live.values() for st in optimizer.state.values()
                   for t in st.values() if torch.is_tensor(t)]
        return {"adapters": len(self._recent),
                "bytes": sum(t.numel() * t.element_size() for t in tensors + moments)}

    # -- one step -----------------------------------------------------------------------
    def step(self, model_id: str, adapter: AdapterConfig, training: TrainingConfig, state: dict | None,
             samples: list, seed: int, replay: list = (), ewc: EwcConfig | None = None,
             measure_noise: bool = False, between=None) -> StepResult:
        """`measure_noise`: also return the micro-batches' gradient norms (StepResult.noise).
        `between`: called before every micro-batch after the first (operators/arbiter.py
        yields the device there); it may wait, never touch the model: the step's result is
        the same with or without it."""
        with self._lock:
            return self._step(model_id, adapter, training, state, samples, seed, replay, ewc, measure_noise, between)

    def _step(self, model_id: str, adapter: AdapterConfig, training: TrainingConfig, state: dict | None,
              samples: list, seed: int, replay: list = (), ewc: EwcConfig | None = None,
              measure_noise: bool = False, between=None) -> StepResult:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        started = time.perf_counter()
        torch.manual_seed(seed)
        name, params = self._activate(model_id, adapter)
        fresh = state is None or state.get("shape") != adapter.shape_key
        live = self._live.get(name)
        if fresh:
            self._reset_adapter(name, seed)
            optimizer = torch.optim.AdamW([p for _, p in params], lr=training.lr)
        elif live is not None and live[0] == state.get("sha256"):
            optimizer = live[1]  # this worker's adapter and optimizer already hold exactly that state
        else:  # a restore, or the key moved here: load the state
            set_peft_model_state_dict(self.model, load_safetensors(state["lora"]), adapter_name=name)
            optimizer = torch.optim.AdamW([p for _, p in params], lr=training.lr)
            optimizer.load_state_dict(torch.load(io.BytesIO(state["optim"]), weights_only=True))
        for group in optimizer.param_groups:  # a hot config may change the learning rate
            group["lr"] = training.lr

        examples, weights = self._encode(samples, training)
        replayed, replay_weights = self._encode(replay, training)
        tokens = sum(len(e["input_ids"]) for e in examples + replayed)
        consolidated = load_safetensors(state["ewc"]) if ewc and not fresh and state.get("ewc") else None
        penalty = _ewc_penalty(params, consolidated, ewc.strength) if consolidated else None
        if training.exact_losses:
            loss_before = self._mean_loss(examples, weights, training)
        noise = _NoiseMeter(params) if measure_noise else None
        first_pass, last_pass = self._train(examples + replayed, weights + replay_weights, training, optimizer,
                                            seed, penalty, own=len(examples), noise=noise, between=between)
        if training.exact_losses:
            loss_after = self._mean_loss(examples, weights, training)
        else:
            loss_before, loss_after = first_pass, last_pass

        lora = {k: v.detach().to("cpu").clone().contiguous()
                for k, v in get_peft_model_state_dict(self.model, adapter_name=name).items()}
        lora_bytes = save_safetensors(lora)
        optim_buf = io.BytesIO()
        torch.save(optimizer.state_dict(), optim_buf)
        steps = (0 if fresh else state["steps"]) + 1
        extra = {"ewc": self._consolidate(params, examples, weights, training, consolidated, ewc)} if ewc else {}
        sha256 = hashlib.sha256(lora_bytes).hexdigest()
        self._live[name] = (sha256, optimizer)
        config = self.model.peft_config[name].to_dict()
        config.update(base_model_name_or_path=self.base_dir, inference_mode=True)
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        # The config is part of the version: the address covers it (and any other file) through the manifest.
        files = with_manifest({"adapter_config.json": json.dumps(config, indent=2, sort_keys=True).encode(),
                               "adapter_model.safetensors": lora_bytes})
        return StepResult(
            state={"shape": adapter.shape_key, "lora": lora_bytes, "optim": optim_buf.getvalue(), "steps": steps,
                   "sha256": sha256, **extra},
            files=files, sha256=artifact_sha256(files), fresh_adapter=fresh, noise=noise.sample() if noise else None,
            metrics={"loss_before": loss_before, "loss_after": loss_after, "samples": len(samples),
                     "tokens": tokens, "step_seconds": round(time.perf_counter() - started, 4),
                     **({"replayed": len(replay)} if replay else {})})

    def _encode(self, samples: list, training: TrainingConfig) -> tuple[list, list]:
        return ([encode_example(self.tokenizer, s.prompt, s.completion, training.max_seq_len) for s in samples],
                [float(s.weight) for s in samples])

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, model_id: str, adapter: AdapterConfig, training: TrainingConfig, samples: list,
                 lora: bytes | None = None) -> dict:
        """{"exact_match", "loss", "correct"} of an adapter on `samples` (unweighted; `correct`:
        which samples it answered exactly): the adapter `model_id`
        trains as it stands now, or, given `lora` (adapter_model.safetensors bytes), those
        weights loaded into a scoring slot beside it. Deterministic on the CPU."""
        with self._lock:
            from peft import set_peft_model_state_dict

            torch.manual_seed(0)
            if lora is None:
                self._activate(model_id, adapter)
            else:
                name, _ = self._activate(model_id, adapter, role="c")
                set_peft_model_state_dict(self.model, load_safetensors(lora), adapter_name=name)
            examples = [encode_example(self.tokenizer, s.prompt, s.completion, training.max_seq_len) for s in samples]
            loss = self._mean_loss(examples, [1.0] * len(examples), training)
            correct = self._exact_answers(samples, training)
            return {"exact_match": round(sum(correct) / len(correct), 6) if correct else 0.0, "loss": loss,
                    "correct": correct}

    @torch.no_grad()
    def _exact_answers(self, samples: list, training: TrainingConfig, batch_size: int = 64) -> tuple[bool, ...]:
        """Per sample: whether its greedy continuation (up to eos) equals the completion."""
        self.model.eval()
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        pad = eos if pad is None else pad
        hits = []
        for start in range(0, len(samples), batch_size):
            chunk = samples[start:start + batch_size]
            prompts = [self.tokenizer(s.prompt)["input_ids"][-training.max_seq_len:] for s in chunk]
            targets = [s.completion.strip() for s in chunk]
            new_tokens = 1 + max(len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in targets)
            width = max(len(p) for p in prompts)  # left-padded: every prompt ends where generation starts
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
            with self._autocast(training):
                out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                          do_sample=False, eos_token_id=eos, pad_token_id=pad)
            for row, target in zip(out[:, width:].tolist(), targets):
                row = row[:row.index(eos)] if eos in row else row
                hits.append(self.tokenizer.decode(row, skip_special_tokens=True).strip() == target)
        return tuple(hits)

    def _reset_adapter(self, name: str, seed: int) -> None:
        torch.manual_seed(seed)
        for module in self.model.modules():
            if hasattr(module, "reset_lora_parameters") and name in getattr(module, "lora_A", {}):
                module.reset_lora_parameters(name, True)

    def _batches(self, examples: list, weights: list, size: int, order: list[int] | None = None):
        """(the examples' indices, batch, weights) of `size` examples at a time, in `order`."""
        order = list(range(len(examples))) if order is None else order
        for i in range(0, len(order), size):
            idx = order[i:i + size]
            batch = collate([examples[j] for j in idx], self.tokenizer.pad_token_id)
            yield (idx, {k: v.to(self.device) for k, v in batch.items()},
                   torch.tensor([weights[j] for j in idx], device=self.device))

    def _loss(self, batch: dict, weights: torch.Tensor, total_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted mean over samples of each sample's mean token loss (over `total_weight`
        when given: the weight of a whole accumulation group)."""
        total = weights.sum() if total_weight is None else total_weight
        return (self._sample_losses(batch) * weights).sum() / total.clamp(min=1e-8)

    def _sample_losses(self, batch: dict) -> torch.Tensor:
        """Each sample's mean token loss."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits, labels = logits[:, :-1].float(), batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                                      reduction="none")
        mask = (labels != -100).float()
        return (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)

    def _autocast(self, training: TrainingConfig):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.precision)
        if dtype is None or (dtype is torch.float16 and self.device.type != "cuda"):
            return torch.autocast(self.device.type, enabled=False)  # fp16 needs a GPU: fp32 on CPU
        return torch.autocast(self.device.type, dtype=dtype)

    @torch.no_grad()
    def _mean_loss(self, examples: list, weights: list, training: TrainingConfig) -> float:
        self.model.eval()
        total, weight = 0.0, 0.0
        for _, batch, w in self._batches(examples, weights, training.micro_batch_size):
            with self._autocast(training):
                total += float(self._loss(batch, w)) * float(w.sum())
            weight += float(w.sum())
        return round(total / weight, 6) if weight else 0.0

    def _consolidate(self, params: list, examples: list, weights: list, training: TrainingConfig,
                     previous: dict | None, ewc: EwcConfig) -> bytes:
        """This step's anchor (the weights now) and running Fisher, as safetensors bytes."""
        self.model.eval()
        squares = {n: torch.zeros_like(p) for n, p in params}
        batches = 0
        for _, batch, w in self._batches(examples, weights, training.micro_batch_size):
            if float(w.sum()) == 0.0:
                continue
            self.model.zero_grad(set_to_none=True)
            with self._autocast(training):
                self._loss(batch, w).backward()
            for n, p in params:
                if p.grad is not None:
                    squares[n] += p.grad.detach().float() ** 2
            batches += 1
        self.model.zero_grad(set_to_none=True)
        tensors = {}
        for n, p in params:
            fisher = squares[n] / max(batches, 1)
            if previous is not None and f"fisher.{n}" in previous:
                fisher = ewc.fisher_decay * previous[f"fisher.{n}"].to(fisher.device) + fisher
            tensors[f"fisher.{n}"] = fisher.cpu().contiguous()
            tensors[f"anchor.{n}"] = p.detach().cpu().clone().contiguous()
        return save_safetensors(tensors)

    def _train(self, examples: list, weights: list, training: TrainingConfig, optimizer, seed: int,
               penalty=None, own: int | None = None, noise: "_NoiseMeter | None" = None,
               between=None) -> tuple[float, float]:
        """Train on `examples`; returns the weighted mean loss of the first `own` examples (the
        window's, not replayed ones) in the first pass and in the last pass, as they were
        trained: in the first pass each sample's loss before any step on it (progressive
        validation; the exact loss before training when the window is one micro-batch)."""
        self.model.train()
        own = len(examples) if own is None else own
        scaler = torch.amp.GradScaler(enabled=training.precision == "fp16" and self.device.type == "cuda")
        optimizer.zero_grad(set_to_none=True)
        micro_batches = []  # (pass, the examples' indices, batch, weights)
        for epoch in range(training.epochs):
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            micro_batches += [(epoch, idx, batch, w)
                              for idx, batch, w in self._batches(examples, weights, training.micro_batch_size, order)
                              if float(w.sum()) != 0.0]  # all rejected: nothing to learn from it
        # [first pass, last pass] x [loss sum, weight], on the device: no sync per micro-batch
        seen = torch.zeros(2, 2, device=self.device)
        started = False  # `between` runs between micro-batches, not before the first
        for first in range(0, len(micro_batches), training.flush_every):
            group = micro_batches[first:first + training.flush_every]
            # Each micro-batch's weighted loss sum over the whole group's weight: the group's
            # gradients add up to those of one batch holding all its samples.
            group_weight = sum(w.sum() for _, _, _, w in group)
            for epoch, idx, batch, w in group:
                if between is not None and started:
                    between()
                started = True
                if noise is not None:
                    noise.before()
                with self._autocast(training):
                    losses = self._sample_losses(batch)
                    loss = (losses * w).sum() / group_weight.clamp(min=1e-8)
                scaler.scale(loss).backward()
                if noise is not None:
                    # This micro-batch's gradient, of its own weighted mean loss, unscaled.
                    unscale = scaler.get_scale() if scaler.is_enabled() else 1.0
                    noise.after(float(group_weight.clamp(min=1e-8)) / float(w.sum()) / unscale, len(idx))
                mine = w * torch.tensor([j < own for j in idx], device=w.device)
                weighted = torch.stack([(losses.detach().float() * mine).sum(), mine.sum()])
                if epoch == 0:
                    seen[0] += weighted
                if epoch == training.epochs - 1:
                    seen[1] += weighted
            if penalty is not None:
                scaler.scale(penalty()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        first_pass, last_pass = (round(float(s / w), 6) if w > 0 else 0.0 for s, w in seen.tolist())
        return first_pass, last_pass


class _NoiseMeter:
    """The micro-batch gradients of a step, reduced to what the gradient noise scale needs
    (operators/granularity.py): the mean of |g_i|² and the sum of the g_i, each g_i the
    difference of the accumulated gradients across one micro-batch's backward pass. It only
    reads gradients: the step trains the same with it."""

    def __init__(self, params: list):
        self.params = [p for _, p in params]
        self.total: list[torch.Tensor] | None = None
        self.square_sum, self.count, self.samples = 0.0, 0, 0
        self._before: list[torch.Tensor] = []

    def _grads(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.detach().float().clone()
                for p in self.params]

    def before(self) -> None:
        self._before = self._grads()

    def after(self, scale: float, samples: int) -> None:
        g = [(a - b) * scale for a, b in zip(self._grads(), self._before)]
        self.square_sum += float(sum((t * t).sum() for t in g))
        self.total = g if self.total is None else [t + x for t, x in zip(self.total, g)]
        self.count += 1
        self.samples += samples

    def sample(self):
        from operators.granularity import NoiseSample

        if self.count < 2:
            return None  # one micro-batch: no spread to measure
        mean = [t / self.count for t in self.total]
        return NoiseSample(micro_batch_sq=self.square_sum / self.count, step_sq=float(sum((t * t).sum() for t in mean)),
                           micro_batch_size=self.samples / self.count, step_size=float(self.samples))


def _ewc_penalty(params: list, consolidated: dict, strength: float):
    """(strength/2)·Σ F·(θ − θ_anchor)² over the adapter's parameters, as a callable."""
    terms = [(p, consolidated[f"fisher.{n}"].to(p.device), consolidated[f"anchor.{n}"].to(p.device))
             for n, p in params if f"fisher.{n}" in consolidated]

    def penalty() -> torch.Tensor:
        return 0.5 * strength * sum((f * (p - a) ** 2).sum() for p, f, a in terms)
    return penalty


def threads_from_env() -> None:
    """Pin torch's CPU threads (STREAMTUNE_TORCH_THREADS, default 1) for reproducible steps."""
    torch.set_num_threads(int(os.environ.get("STREAMTUNE_TORCH_THREADS", "1")))
