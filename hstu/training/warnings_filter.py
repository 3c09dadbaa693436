"""Silence known third-party deprecation noise on the launchers' console, and nothing else.

:func:`install` adds one ``warnings`` filter per known message (by category, message pattern and,
where the emitting module is stable, module pattern) and one logging filter per known logger
message. The launch scripts call it before they import torch, torchrec or fbgemm (module-level
deprecation warnings fire at import time); every other warning still shows. The library itself
installs nothing: code that imports hstu keeps its own warning settings.

The messages filtered, all about the libraries' own internals or about choices a user of the
launchers cannot change:

- fbgemm_gpu: ``The Python module fbgemm_gpu.<name> is now DEPRECATED`` and ``Failed to import:
  fbgemm_gpu.split_embedding_codegen_lookup_invokers.<optional SSD op>`` (DeprecationWarnings at
  import, through torchrec; Python hides them unless warnings are enabled, e.g. ``-W default``);
- torch: ``torch.jit.script`` / ``torch.jit.interface`` is deprecated (DeprecationWarnings raised
  while torchrec and fbgemm import; hstu calls neither);
- torchrec: ``apply_optimizer_in_backward``'s "This API is deprecated" (DeprecationWarning; the
  fused sparse optimizers of torchrec's sharders are attached through it),
  ``HeuristicalStorageReservation is known to cause issues`` (planner, FutureWarning),
  `` `broadcast_buffers` is deprecated`` (torchrec's DDP wrapping, FutureWarning), and the
  planner's log warnings ``The topology was constructed directly ...`` and ``There is a known
  issue with TorchRec's dense tensor size calculation ...``;
- torch: ``Please use DTensor instead and we are deprecating ShardedTensor.`` (FutureWarning
  raised by torchrec's sharded state dicts) and the fx log warning ``is_fx_tracing will return
  true for both fx.symbolic_trace and torch.export ...``.
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["LOG_FILTERS", "WARNING_FILTERS", "install"]

# (category, message regex matched from the start of the text, module regex or "")
WARNING_FILTERS: tuple[tuple[type[Warning], str, str], ...] = (
    (DeprecationWarning, r"(?s).*The Python module fbgemm_gpu\.\S+ is now DEPRECATED", ""),
    (
        DeprecationWarning,
        r"(?s).*Failed to import: fbgemm_gpu\.split_embedding_codegen_lookup_invokers\.",
        r"fbgemm_gpu\.",
    ),
    # torchrec and fbgemm script modules at import (hstu itself uses neither API)
    (DeprecationWarning, r"`torch\.jit\.(script|interface)` is deprecated", r"torch\.jit\."),
    (
        DeprecationWarning,
        r"This API is deprecated\. Please use Pytorch Distributed's _apply_optimizer_in_backward",
        r"torchrec\.optim\.",
    ),
    (FutureWarning, r"HeuristicalStorageReservation is known to cause issues", r"torchrec\."),
    (FutureWarning, r"`broadcast_buffers` is deprecated", r"(torchrec|torch)\."),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", ""),
)

# logger name -> message regexes (searched in the formatted message)
LOG_FILTERS: dict[str, tuple[str, ...]] = {
    "torchrec.distributed.planner.types": (
        r"^The topology was constructed directly rather than via TopologyFactory",
    ),
    "torchrec.distributed.planner.storage_reservations": (
        r"^There is a known issue with TorchRec's dense tensor size calculation",
    ),
    "torch.fx._symbolic_trace": (r"^is_fx_tracing will return true for both",),
}


class _DropMessages(logging.Filter):
    """Drops the records of one logger whose message matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not any(p.search(text) for p in self.patterns)


def install() -> None:
    """Install the filters above; calling it again changes nothing (``warnings`` replaces an
    identical filter, a logger gets one filter of ours)."""
    for category, message, module in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, patterns in LOG_FILTERS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in log.filters):
            log.addFilter(_DropMessages(patterns))
