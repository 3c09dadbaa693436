"""`SequenceData`: the one in-memory (and cached on-disk) form of every dataset.

Every source (the synthetic generator, MovieLens, KuaiRand, SASRec-style files) becomes per-user,
time-ordered interaction sequences in CSR form. Training datasets and the evaluation protocol
read only this, so a new source needs only a converter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SequenceData", "DATA_FILE", "MANIFEST_FILE"]

DATA_FILE = "sequences.npz"
MANIFEST_FILE = "manifest.json"


@dataclass
class SequenceData:
    """Per-user time-ordered sequences.

    user_ids [U] int64 (raw user id, >= 0), offsets [U+1] int64 (CSR into the item arrays),
    item_ids [N] int64 (>= 0; 0 is a valid id, the models reserve no padding id),
    actions [N] int64 (bitmask over ``action_names``: bit k set = task k positive),
    timestamps [N] int64 (non-decreasing within each user),
    user_features [U, F] int64 (categorical contextual features, ids >= 0).
    """

    name: str
    user_ids: np.ndarray
    offsets: np.ndarray
    item_ids: np.ndarray
    actions: np.ndarray
    timestamps: np.ndarray
    user_features: np.ndarray
    user_feature_names: list[str] = field(default_factory=list)
    action_names: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def num_users(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_interactions(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def num_tasks(self) -> int:
        return len(self.action_names)

    @property
    def item_vocab_size(self) -> int:
        """max item id + 1 (ids need not be dense)."""
        return int(self.item_ids.max()) + 1 if self.item_ids.size else 0

    @property
    def user_feature_cardinalities(self) -> list[int]:
        """max id + 1 per contextual feature."""
        if self.user_features.size == 0:
            return [1] * self.user_features.shape[1]
        return [int(x) + 1 for x in self.user_features.max(axis=0)]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def item_corpus(self) -> np.ndarray:
        """Sorted unique item ids: the full corpus that retrieval ranks against."""
        return np.unique(self.item_ids)

    def user_slice(self, u: int) -> slice:
        return slice(int(self.offsets[u]), int(self.offsets[u + 1]))

    # ---- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first broken invariant."""
        u = self.user_ids.shape[0]
        arrays = {
            "user_ids": self.user_ids,
            "offsets": self.offsets,
            "item_ids": self.item_ids,
            "actions": self.actions,
            "timestamps": self.timestamps,
            "user_features": self.user_features,
        }
        for key, arr in arrays.items():
            if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{self.name}: {key} must be an integer numpy array")
        if self.offsets.shape != (u + 1,):
            raise ValueError(f"{self.name}: offsets must have shape [{u + 1}]")
        if u and (self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0)):
            raise ValueError(f"{self.name}: offsets must start at 0 and be non-decreasing")
        n = int(self.offsets[-1]) if u else 0
        for key in ("item_ids", "actions", "timestamps"):
            if arrays[key].shape != (n,):
                raise ValueError(f"{self.name}: {key} must have shape [{n}]")
        if self.user_features.ndim != 2 or self.user_features.shape[0] != u:
            raise ValueError(f"{self.name}: user_features must have shape [{u}, F]")
        if self.user_features.shape[1] != len(self.user_feature_names):
            raise ValueError(f"{self.name}: user_feature_names must name each user feature column")
        if n and self.item_ids.min() < 0:
            bad = int(np.argmax(self.item_ids < 0))
            raise ValueError(
                f"{self.name}: negative item id {int(self.item_ids[bad])} at row {bad}"
            )
        if u and self.user_ids.min() < 0:
            raise ValueError(f"{self.name}: negative user id")
        if self.user_features.size and self.user_features.min() < 0:
            raise ValueError(f"{self.name}: negative contextual feature id")

    # ---- cache ---------------------------------------------------------------------------
    def save(self, directory: str | Path, manifest: dict | None = None) -> Path:
        """Write ``sequences.npz`` + ``manifest.json`` atomically into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (DATA_FILE + ".tmp.npz")
        np.savez(
            tmp,
            user_ids=self.user_ids,
            offsets=self.offsets,
            item_ids=self.item_ids,
            actions=self.actions,
            timestamps=self.timestamps,
            user_features=self.user_features,
        )
        tmp.replace(directory / DATA_FILE)
        meta = {
            "name": self.name,
            "num_users": self.num_users,
            "num_items": int(self.item_corpus().size),
            "num_interactions": self.num_interactions,
            "item_id_range": [int(self.item_ids.min()), int(self.item_ids.max())]
            if self.num_interactions
            else [0, -1],
            "user_feature_names": list(self.user_feature_names),
            "user_feature_cardinalities": self.user_feature_cardinalities,
            "action_names": list(self.action_names),
            "extra": self.extra,
        }
        meta.update(manifest or {})
        tmp_m = directory / (MANIFEST_FILE + ".tmp")
        tmp_m.write_text(json.dumps(meta, indent=2, sort_keys=True))
        tmp_m.replace(directory / MANIFEST_FILE)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> SequenceData:
        directory = Path(directory)
        data_path, man_path = directory / DATA_FILE, directory / MANIFEST_FILE
        if not data_path.exists() or not man_path.exists():
            raise FileNotFoundError(
                f"no prepared dataset in {directory} (expected {DATA_FILE} and {MANIFEST_FILE}); "
                f"prepare it with: python -m hstu.data.prepare --dataset <name> --source <raw files>"
            )
        meta = json.loads(man_path.read_text())
        with np.load(data_path) as z:
            arrays = {k: z[k] for k in z.files}
        return cls(
            name=meta["name"],
            user_feature_names=list(meta.get("user_feature_names", [])),
            action_names=list(meta.get("action_names", [])),
            extra=dict(meta.get("extra", {})),
            **arrays,
        )
