"""Live imatrix collection inside a serving process.

The server registers a :class:`LiveImatrix` as a runtime observer and calls ``request_done()`` after
each completed request. Only aggregate statistics exist: per-column sums of x² and row counts per
tensor (and per expert), plus the number of completed requests. No text, token ids, positions or
request identifiers are accepted by any method, so none can reach the file; the dataset label
written into the file is the operator's, fixed at construction.

Snapshots: after every ``every`` completed requests once at least ``min_requests`` were seen
(``every = 0``: only ``close()``), each a full rewrite through ``atomic_output`` (temp file, fsync,
rename), so a reader, or a crash, only ever sees a complete previous or new snapshot. The output's folder
is checked (exists, writable) at construction, so a server fails before it loads its model, not at
shutdown; a final snapshot that still fails (disk full, folder removed) is one ForgeError naming the file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from forge.atomic import check_output_path
from forge.errors import ForgeError
from forge.imatrix.accumulate import ImatrixAccumulator
from forge.imatrix.formats import Format, format_for_path, write_imatrix


class LiveImatrix(ImatrixAccumulator):
    """Thread-safe accumulator with periodic atomic snapshots (defaults as ds4's server: 64 and 8)."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        every: int = 64,
        min_requests: int = 8,
        fmt: Format | None = None,
        dataset: str = "live",
        chunk_size: int = 512,
        process_output: bool = False,
        n_experts: int | None = None,
    ) -> None:
        super().__init__(process_output=process_output, n_experts=n_experts)
        if every < 0 or min_requests < 0:
            raise ValueError("every and min_requests must be >= 0")
        self.out = check_output_path(out)  # folder exists and is writable, the name is not a folder
        self.every, self.min_requests = every, min_requests
        self.fmt: Format = fmt or format_for_path(out)
        self.dataset, self.chunk_size = dataset, chunk_size
        self.requests = 0
        self.snapshots = 0
        self._lock = threading.Lock()  # guards the sums and the request count
        self._write_lock = threading.Lock()  # one writer at a time, newest data last

    def on_matmul_input(self, tensor_name: str, x: torch.Tensor, expert_ids: torch.Tensor | None) -> None:
        if not self.wants(tensor_name):
            return
        with self._lock:
            super().on_matmul_input(tensor_name, x, expert_ids)

    def on_routing(
        self, layer: int, experts: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor
    ) -> None:
        with self._lock:
            super().on_routing(layer, experts, weights, logits)

    def request_done(self) -> bool:
        """Count one completed request; write a snapshot when one is due. Returns True if it wrote."""
        with self._lock:
            self.requests += 1
            due = self.every > 0 and self.requests >= self.min_requests and self.requests % self.every == 0
        return self.snapshot() if due else False

    def snapshot(self) -> bool:
        """Write the current totals (nothing before ``min_requests`` or without data). Returns True if written."""
        with self._write_lock:
            with self._lock:  # copy under the lock; write outside it so inference is not held up
                if self.requests < self.min_requests or not self._sums:
                    return False
                im = self.to_imatrix([self.dataset], chunk_count=self.requests, chunk_size=self.chunk_size)
            write_imatrix(im, self.out, self.fmt)
            self.snapshots += 1
            return True

    def close(self) -> bool:
        """Final snapshot (at server shutdown); a failure is a ForgeError ``imatrix snapshot: PATH: reason``."""
        try:
            return self.snapshot()
        except (OSError, ForgeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            reason = reason.removeprefix(f"{self.out}: ")  # atomic_output's own errors name the file too
            raise ForgeError(f"imatrix snapshot: {self.out}: {reason}") from None

    @property
    def path(self) -> Path:
        return self.out
