"""Adaptive update granularity (`trigger_policy.mode: adaptive`): each step's size from the stream.

The statistic is the gradient noise scale B_simple = tr(Σ)/|G|² of McCandlish et al. 2018,
"An Empirical Model of Large-Batch Training" (section 2.2 and appendix A.1): the batch size
beyond which a larger step buys little more progress per sample. Its two terms come from
the micro-batches a step already computes (operators/lora_trainer.py): with micro-batches of
b samples whose mean squared gradient norm is |G_b|², and the step's mean gradient over B = k·b
samples with squared norm |G_B|²,

    |G|²  ≈ (B·|G_B|² − b·|G_b|²) / (B − b)        tr(Σ) ≈ (|G_b|² − |G_B|²) / (1/b − 1/B)

both unbiased; as the paper does, each is averaged over steps (here an exponential mean,
`noise_decay`) before the ratio is taken. Only the LoRA parameters' gradients enter: those
are the ones the step moves. The next step's size is B_simple clamped to
[min_samples_low, min_samples_high]. Consistent gradients (a clean, stable task) give a
small B_simple: small, frequent steps. Noisy ones give a large one: wait for more samples.

A distribution shift is seen first in the loss: when a window's loss before training
(progressive validation, operators/lora_trainer.py) is `shift_z` standard deviations above
its running mean, the next step drops to min_samples_low and the noise means restart, since
they described the old distribution.

>>> from core.messages import AdaptiveGranularity
>>> bounds = AdaptiveGranularity(min_samples_low=8, min_samples_high=64, noise_decay=0.0)
>>> s = GranularityState.initial(16)
>>> s.size, s.rule
(16, 'initial')
>>> consistent = NoiseSample(micro_batch_sq=1.02, step_sq=1.0, micro_batch_size=4, step_size=16)
>>> next_state(s, bounds, consistent, loss_before=2.0).size   # B_simple ~ 0.1: the lower bound
8
>>> noisy = NoiseSample(micro_batch_sq=5.0, step_sq=1.5, micro_batch_size=4, step_size=16)
>>> round(noise_scale(noisy.signal, noisy.noise), 1), next_state(s, bounds, noisy, loss_before=2.0).size
(56.0, 56)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from core.messages import AdaptiveGranularity, GranularityDecision


@dataclass(frozen=True)
class NoiseSample:
    """One step's gradient norms: the mean over its micro-batches of |g_i|² (each g_i the
    gradient of a micro-batch's mean loss) and |ḡ|² of their mean, with the sizes in samples."""

    micro_batch_sq: float
    step_sq: float
    micro_batch_size: float
    step_size: float

    @property
    def signal(self) -> float:
        """Unbiased |G|² (McCandlish et al. 2018, eq. A.2)."""
        b, big = self.micro_batch_size, self.step_size
        return (big * self.step_sq - b * self.micro_batch_sq) / (big - b)

    @property
    def noise(self) -> float:
        """Unbiased tr(Σ), the per-sample gradient variance (McCandlish et al. 2018, eq. A.3)."""
        b, big = self.micro_batch_size, self.step_size
        return (self.micro_batch_sq - self.step_sq) / (1 / b - 1 / big)


def noise_scale(signal: float, noise: float) -> float:
    """B_simple = tr(Σ)/|G|²; infinite when no signal is left (all noise)."""
    return math.inf if signal <= 0 else max(noise, 0.0) / signal


@dataclass(frozen=True)
class GranularityState:
    """Per model, in keyed state: the size of the next step, why, and the running means."""

    size: int
    rule: str = "initial"
    statistic: float | None = None
    threshold: float | None = None
    reason: str = "no statistic yet: min_samples_per_window"
    signal: float | None = None      # running mean of |G|²
    noise: float | None = None       # running mean of tr(Σ)
    loss_mean: float | None = None
    loss_var: float = 0.0
    steps: int = 0
    measured: float | None = None    # the last step's own B_simple estimate
    loss_z: float | None = None      # the last step's loss against the running mean

    @classmethod
    def initial(cls, size: int) -> "GranularityState":
        return cls(size=size)

    def decision(self, bounds: AdaptiveGranularity, measured: float | None = None,
                 loss_z: float | None = None) -> GranularityDecision:
        """This state's size as the version record tells it (with what the step measured)."""
        finite = measured if measured is None or math.isfinite(measured) else None
        return GranularityDecision(
            size=self.size, rule=self.rule, statistic=_rounded(self.statistic), threshold=_rounded(self.threshold),
            bounds=(bounds.min_samples_low, bounds.min_samples_high), reason=self.reason,
            measured_noise_scale=_rounded(finite), loss_z=_rounded(loss_z))


def _rounded(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)


def _mean(old: float | None, new: float, decay: float) -> float:
    return new if old is None else decay * old + (1 - decay) * new


def next_state(state: GranularityState, bounds: AdaptiveGranularity, sample: NoiseSample | None,
               loss_before: float) -> GranularityState:
    """The state after a step: its loss and gradient norms folded in, the next size chosen.

    A step with a single micro-batch (`sample` None) says nothing of the noise: the size
    stays unless the loss shifted.
    """
    steps = state.steps + 1
    # The loss test: against the mean and variance of the steps before this one.
    z = None
    if state.loss_mean is not None and state.steps >= bounds.warmup_steps:
        z = (loss_before - state.loss_mean) / math.sqrt(max(state.loss_var, 1e-12))
    loss_mean = _mean(state.loss_mean, loss_before, bounds.loss_decay)
    deviation = 0.0 if state.loss_mean is None else loss_before - state.loss_mean
    loss_var = bounds.loss_decay * (state.loss_var + (1 - bounds.loss_decay) * deviation ** 2)
    if z is not None and z > bounds.shift_z:
        # A new distribution: react in small steps; the noise means described the old one.
        return GranularityState(
            size=bounds.min_samples_low, rule="loss_shift", statistic=z, threshold=bounds.shift_z,
            reason=f"loss {loss_before:.4g} is {z:.2f} standard deviations above its running mean "
                   f"{state.loss_mean:.4g} (> {bounds.shift_z}): steps of {bounds.min_samples_low} samples",
            loss_mean=loss_mean, loss_var=loss_var, steps=steps, loss_z=z)
    if sample is None:
        return replace(state, loss_mean=loss_mean, loss_var=loss_var, steps=steps, measured=None, loss_z=z)
    signal = _mean(state.signal, sample.signal, bounds.noise_decay)
    noise = _mean(state.noise, sample.noise, bounds.noise_decay)
    scale = noise_scale(signal, noise)
    low, high = bounds.min_samples_low, bounds.min_samples_high
    size = high if not math.isfinite(scale) else min(high, max(low, round(scale)))
    where = "within" if low <= scale <= high else ("below" if scale < low else "above")
    return GranularityState(
        size=size, rule="noise_scale", statistic=scale, threshold=None,
        reason=f"gradient noise scale {scale:.4g} {where} [{low}, {high}]: steps of {size} samples",
        signal=signal, noise=noise, loss_mean=loss_mean, loss_var=loss_var, steps=steps,
        measured=noise_scale(sample.signal, sample.noise), loss_z=z)
