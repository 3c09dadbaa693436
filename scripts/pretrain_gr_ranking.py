#!/usr/bin/env python
"""Train an HSTU ranking model: torchrun --nproc_per_node=N scripts/pretrain_gr_ranking.py --gin-config-file ...

Exit codes: 0 done, 1 runtime failure, 2 configuration/usage/data error (README "Exit codes").
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# known third-party deprecation noise is filtered before torch, torchrec and fbgemm are imported
from hstu.training import warnings_filter  # noqa: E402

warnings_filter.install()

from hstu.training.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("ranking"))
