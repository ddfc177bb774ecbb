"""Stop requests: SIGINT/SIGTERM end a training run cleanly at the end of an optimizer step."""

from __future__ import annotations

import signal
import sys
import threading

import torch

from draftline.stages.train.distributed import Runtime, all_reduce_max


class StopRequest:
    """SIGINT/SIGTERM ask the loop to stop at the end of the current optimizer step, after a
    checkpoint, so that a rerun continues from that very step (a second signal stops at once).

    Every rank sees the request in the same step (a max over ranks), so the checkpoint, a
    collective under FSDP, is written by all or none.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second signal {signum}: stopping now")
        self.signum = signum
        print(f"\nsignal {signum}: stopping after this step with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self, rt: Runtime) -> int | None:
        """The signal number when any rank was asked to stop, else None."""
        mine = all_reduce_max(torch.tensor([float(self.signum or 0)]), rt)
        return int(mine.item()) or None
