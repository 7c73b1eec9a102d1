"""train.compile: the training forward through torch.compile, with a fallback to eager.

compiled_forward tries the compiled module on one batch, forward and backward (where inductor
compiles), before training starts; if that fails the model itself is used. The trial restores
the RNG state and drops its gradients, so the run that follows draws what a run without the
trial draws. Later failures (a shape the trial did not see) turn the forward eager for good
(Compiled). Either way the run says why in a warning and trains on; the compiled module shares
the model's parameters, so validation and checkpoints use the model itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from xformer.events import Event
from xformer.training.device import Runtime

BACKEND = "inductor"  # what train.compile hands torch.compile


class Compiled:
    """A module's compiled forward that turns eager for good on the first failure; the same
    call then runs eagerly, so a real error (not the compiler's) is raised there."""

    def __init__(self, model: nn.Module, on_failure: Callable[[Exception], None]):
        self.model, self.on_failure = model, on_failure
        self.forward = torch.compile(model, backend=BACKEND, dynamic=True)

    def __call__(self, *args, **kwargs):
        if self.forward is not self.model:
            try:
                return self.forward(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - anything the compiler raises; eager re-raises real errors
                self.forward = self.model
                self.on_failure(error)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def compiled_forward(model: nn.Module, trial: Callable[[Callable], None], rt: Runtime, emit: Event):
    """The model behind a compiled forward, or the model itself when `trial(forward)` (one
    batch's loss and backward through `forward`) fails to compile."""
    def failed(error: Exception) -> None:
        root = error  # the compiler's own error, under dynamo's wrappers
        while getattr(root, "inner_exception", None) or root.__cause__:
            root = getattr(root, "inner_exception", None) or root.__cause__
        why = str(root).strip().splitlines()
        emit("warning", {"message": f"train.compile: torch.compile failed ({type(root).__name__}"
                                    f"{': ' + why[0][:200] if why else ''}); training without it"})

    emit("setup", {"message": "train.compile: compiling the model on the first batch"})
    wrapped = Compiled(model, failed)
    state = rt.state()
    try:
        trial(wrapped.forward)
    except Exception as error:  # noqa: BLE001 - as in Compiled
        failed(error)
        wrapped.forward = model
    finally:
        rt.load_state(*state)
        model.zero_grad(set_to_none=True)
    return wrapped if wrapped.forward is not model else model
