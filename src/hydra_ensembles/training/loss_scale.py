"""fp16's loss scale as one policy object: the first scale, and a step whose scaled gradients
overflow taken again at half the scale, up to `FP16_RETRIES` times, before it counts as skipped."""

from __future__ import annotations

from typing import Any

import torch

FP16_INITIAL_SCALE = 2.0**10
"""fp16's first loss scale. PyTorch's default, 2^16, overflows the scaled gradients of a
transformer's first steps, so a short fine-tune skipped most of its steps (DINOv2-S: 2 of 3);
at 2^10 a gradient as small as 6e-8 is still a normal fp16 number once scaled."""
FP16_RETRIES = 8
"""Times an fp16 step whose scaled gradients overflow is taken again at half the scale before
it is counted as skipped."""


class LossScale:
    """The dynamic loss scale of one fp16 run (`torch.amp.GradScaler`)."""

    def __init__(self, device_type: str, initial: float | None = None) -> None:
        start = FP16_INITIAL_SCALE if initial is None else initial
        self.scaler = torch.amp.GradScaler(device_type, init_scale=start)

    @classmethod
    def resumed(cls, device_type: str, history: list[dict[str, Any]]) -> LossScale:
        """The scale the last finished epoch of ``history`` ended with (the first scale where none)."""
        last = history[-1].get("loss_scale", FP16_INITIAL_SCALE) if history else FP16_INITIAL_SCALE
        return cls(device_type, float(last))

    @property
    def value(self) -> float:
        return float(self.scaler.get_scale())

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step; False where the scaled gradients overflowed and it was skipped (the
        scale is then halved, and the caller takes the step again, `FP16_RETRIES` times at most)."""
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale
