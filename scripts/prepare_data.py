#!/usr/bin/env python
"""Prepare a real dataset (thin wrapper of ``python -m hstu.data.prepare``; same flags).

python scripts/prepare_data.py --dataset ml-1m --source /path/to/ml-1m
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from hstu.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
