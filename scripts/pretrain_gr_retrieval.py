#!/usr/bin/env python
"""Train an HSTU retrieval model: torchrun --nproc_per_node=N scripts/pretrain_gr_retrieval.py --gin-config-file ..."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hstu.training.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("retrieval"))
