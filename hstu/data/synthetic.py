"""Synthetic interaction data with planted, learnable signal (the embedded default dataset).

The generative story, all driven by one ``numpy.random.Generator`` seeded from ``seed``:

- Items belong to ``num_clusters`` latent clusters of equal size; inside a cluster popularity is
  Zipf-distributed, and clusters themselves have Zipf-distributed global popularity.
- Each user has a ``region`` (which tilts a sparse Dirichlet prior towards a few clusters), a
  preference vector over clusters drawn from that prior, an ``age_group`` that shifts the user's
  overall propensity to act, and a ``segment`` that reveals (noisily) the user's top cluster.
- A sequence is a Markov chain over clusters: each step either stays in the previous item's
  cluster (``stay_prob``), explores a globally popular cluster (``explore_prob``), or follows the
  user's preferences. The item is then drawn from the cluster's Zipf popularity (repeats within a
  user are resampled away unless ``allow_repeats``). Next-item retrieval is therefore learnable
  well beyond popularity.
- Each interaction carries a bitmask over ``num_tasks`` actions. Task 0 ("click") is Bernoulli
  with logit = affinity(user, item) = preference for the item's cluster + item quality + user bias;
  the other tasks are gated on a parent action (like needs click, share needs like, ...) and weigh
  the affinity components differently ("dislike" runs the other way). Ranking AUC is thus learnable
  from the user's history and the candidate item.
- Sequence lengths are heavy-tailed (shifted lognormal, clipped); timestamps strictly increase.
- Planted time effect (``time_effect`` = e > 0, ``DatasetArgs.synthetic_time_effect``; off by
  default, and the default data is unchanged bit for bit): every gap between two interactions of
  a user is *short* (minutes: 1 + Exponential(mean 10 min) seconds) or, with probability 0.5,
  *long* (days: lognormal, median 3 days). With probability e a step obeys its gap: after a short
  gap the user continues in the previous item's cluster (items similar to the last one), after a
  long gap they return to an evergreen item (a cluster drawn by squared global popularity, then
  the cluster's Zipf head); the other steps follow the chain above. Labels move too: every action
  logit gets +e after a long gap (-e for "dislike"). The gaps do not depend on the items, so only
  a model that sees the time of the predicted item (its timestamp) can tell which regime applies;
  one that sees positions only has to hedge between them (a count model that knows the gap
  regime gains ~6 points of HR@10 over one that does not, at e = 1). These draws come from a
  second generator seeded from ``[seed, 1]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from hstu.config.args import DatasetArgs
from hstu.config.limits import DataSizes, Driver, MemoryEstimate, MemoryTerm
from hstu.data.sequences import SequenceData

__all__ = [
    "generate_synthetic",
    "generate_synthetic_with_latents",
    "synthetic_generation_memory",
    "synthetic_sizes",
    "SyntheticLatents",
    "SYNTHETIC_ACTION_NAMES",
    "SYNTHETIC_FEATURE_NAMES",
    "TIME_EFFECT_GAP_THRESHOLD_S",
]

logger = logging.getLogger(__name__)

SYNTHETIC_ACTION_NAMES: tuple[str, ...] = (
    "click",
    "long_view",
    "like",
    "comment",
    "share",
    "follow",
    "save",
    "dislike",
)
SYNTHETIC_FEATURE_NAMES: tuple[str, ...] = ("user_id", "segment", "age_group", "region")

# Per task: (parent task or -1, parent value required, weight on preference, weight on item
# quality, weight on user bias, logit offset). A task can only fire where its parent has the
# required value, which nests the tasks (share => like => click) and correlates their labels.
_TASK_SPECS: tuple[tuple[int, int, float, float, float, float], ...] = (
    (-1, 1, 1.0, 1.0, 1.0, 0.0),  # click
    (0, 1, 1.5, 0.5, 0.5, -0.5),  # long_view
    (0, 1, 1.2, 1.0, 0.5, -1.0),  # like
    (0, 1, 1.0, 0.3, 1.0, -2.5),  # comment
    (2, 1, 1.0, 0.5, 0.5, -1.5),  # share
    (0, 1, 0.8, 0.0, 1.0, -3.0),  # follow
    (1, 1, 1.0, 1.5, 0.0, -1.5),  # save
    (0, 0, -1.5, -1.0, -0.5, -2.0),  # dislike (only without a click)
)

_NUM_AGE_GROUPS = 6
_NUM_REGIONS = 8
_NUM_SEGMENTS = 8
_BASE_TIME = 1_600_000_000  # seconds; 2020-09-13
# the planted time effect (time_effect > 0): gap regimes and the stream of its draws
_TIME_STREAM = 1  # its generator: default_rng([seed, _TIME_STREAM])
_LONG_GAP_PROB = 0.5
_SHORT_GAP_MEAN_S = 600.0  # short gaps: 1 + Exponential(10 min) seconds
_LONG_GAP_MEDIAN_S = 3 * 86400.0  # long gaps: lognormal, median 3 days, sigma 0.5
_LONG_GAP_SIGMA = 0.5
_EVERGREEN_SHARPNESS = 2.0  # evergreen cluster ~ cluster_popularity ** this
# every short gap lies below it and every long gap above it (in practice: P < 1e-6 either way)
TIME_EFFECT_GAP_THRESHOLD_S = 6 * 3600


@dataclass(frozen=True)
class SyntheticLatents:
    """The hidden truth behind a synthetic dataset (for tests and diagnostics, not for models).

    item_cluster [I] cluster of each item id; user_pref [U, C] preference over clusters (rows sum
    to 1); user_bias [U] propensity to act; item_quality [I]; affinity_scale: the preference term
    spans [-affinity_scale, +affinity_scale]. With the time effect on, long_gap [N] marks the
    interactions that follow a long gap (and each user's first one) and time_ruled [N] those
    whose item was chosen by their gap; both None otherwise.
    """

    item_cluster: np.ndarray
    cluster_popularity: np.ndarray
    user_pref: np.ndarray
    user_bias: np.ndarray
    item_quality: np.ndarray
    affinity_scale: float
    long_gap: np.ndarray | None = None
    time_ruled: np.ndarray | None = None

    def preference_term(self, user_rows: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Scaled preference of each user for each item's cluster, in [-scale, +scale]."""
        pref = self.user_pref[user_rows, self.item_cluster[items]]
        top = self.user_pref.max(axis=1)[user_rows]
        return self.affinity_scale * (2.0 * pref / top - 1.0)

    def affinity(self, user_rows: np.ndarray, items: np.ndarray) -> np.ndarray:
        """The click logit of (user, item) pairs: preference + item quality + user bias."""
        user_rows = np.asarray(user_rows)
        items = np.asarray(items)
        return (
            self.preference_term(user_rows, items)
            + self.item_quality[items]
            + self.user_bias[user_rows]
        )


# Memory of the generator with its default shape, measured with tracemalloc (numpy arrays) at 20k
# and 100k users: ~260-280 B of peak per interaction, ~73 B per item, plus the [users, clusters]
# float64 preference arrays; the constants below are a little lower (a low estimate), and so is the
# mean sequence length (the default lengths average ~59 items).
_MEAN_LEN_LOW = 50
_MAX_LEN = 1024  # generate_synthetic_with_latents' max_seq_len default
_PEAK_BYTES_PER_INTERACTION = 240
_PEAK_BYTES_PER_ITEM = 64
_PEAK_BYTES_PER_USER_CLUSTER = 40
_KEPT_BYTES_PER_INTERACTION = 24  # item_ids, actions, timestamps: int64 each


def _default_clusters(num_items: int) -> int:
    return int(np.clip(num_items // 50, 2, 64))


def synthetic_sizes(num_users: int, num_items: int, num_tasks: int = 8) -> DataSizes:
    """The sizes `generate_synthetic` (default shape) produces, without generating: a low
    estimate of the interactions, the exact table sizes (for the memory check)."""
    users, items = int(num_users), int(num_items)
    interactions = users * _MEAN_LEN_LOW
    features = len(SYNTHETIC_FEATURE_NAMES)
    return DataSizes(
        num_users=users,
        num_interactions=interactions,
        item_rows=items,
        num_items=items,
        # user_id = the row, segment, age_group, region
        contextual_cardinalities=(users, _NUM_SEGMENTS, _NUM_AGE_GROUPS, _NUM_REGIONS),
        contextual_names=SYNTHETIC_FEATURE_NAMES,
        num_action_bits=max(1, int(num_tasks)),
        longest_sequence=_MAX_LEN,
        array_bytes=interactions * _KEPT_BYTES_PER_INTERACTION + users * 8 * (2 + features),
        source="the synthetic dataset",
        synthetic=True,
    )


def synthetic_generation_memory(num_users: int, num_items: int) -> MemoryEstimate:
    """Host memory `generate_synthetic` (default shape) needs at its peak, a low estimate; the
    terms name the ``DatasetArgs.synthetic_*`` fields for `hstu.config.limits.check_memory`."""
    users, items = int(num_users), int(num_items)
    defaults = DatasetArgs.__dataclass_fields__
    users_d = Driver(
        "DatasetArgs.synthetic_num_users", users, defaults["synthetic_num_users"].default
    )
    items_d = Driver(
        "DatasetArgs.synthetic_num_items", items, defaults["synthetic_num_items"].default
    )
    return MemoryEstimate(
        "host",
        (
            MemoryTerm(
                "interactions",
                users * _MEAN_LEN_LOW * _PEAK_BYTES_PER_INTERACTION
                + users * _default_clusters(items) * _PEAK_BYTES_PER_USER_CLUSTER,
                f"users x {_MEAN_LEN_LOW} items x {_PEAK_BYTES_PER_INTERACTION} B",
                (users_d,),
            ),
            MemoryTerm(
                "items",
                items * _PEAK_BYTES_PER_ITEM,
                f"items x {_PEAK_BYTES_PER_ITEM} B",
                (items_d,),
            ),
        ),
    )


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"generate_synthetic: {name} must be an integer >= {minimum}; got {value!r}"
        )


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair."""
    lengths = ends - starts
    seg = _segment_starts(lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - seg, lengths)


def _segment_starts(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def generate_synthetic_with_latents(
    num_users: int,
    num_items: int,
    seed: int,
    num_tasks: int = 8,
    *,
    num_clusters: int = 0,
    mean_seq_len: float = 60.0,
    min_seq_len: int = 8,
    max_seq_len: int = 1024,
    seq_len_sigma: float = 1.0,
    stay_prob: float = 0.5,
    explore_prob: float = 0.15,
    dirichlet_alpha: float = 0.05,
    region_boost: float = 0.3,
    zipf_exponent: float = 1.2,
    affinity_scale: float = 2.0,
    allow_repeats: bool = False,
    time_effect: float = 0.0,
    name: str = "synthetic",
) -> tuple[SequenceData, SyntheticLatents]:
    """Generate the synthetic dataset and return it with its hidden latents.

    ``num_clusters=0`` picks ``clip(num_items // 50, 2, 64)``. ``time_effect`` in [0, 1]: the
    share of steps whose next item follows the time gap before it (0 = off). See the module
    docstring for the generative story; every draw comes from ``numpy.random.default_rng(seed)``
    (the time effect's from ``default_rng([seed, 1])``).
    """
    _check_positive("num_users", num_users)
    _check_positive("num_items", num_items, 2)
    _check_positive("num_tasks", num_tasks)
    _check_positive("min_seq_len", min_seq_len, 2)
    _check_positive("max_seq_len", max_seq_len, min_seq_len)
    if num_tasks > 62:
        raise ValueError(
            f"generate_synthetic: num_tasks must be <= 62 (int64 bitmask); got {num_tasks}"
        )
    if stay_prob < 0.0 or explore_prob < 0.0 or stay_prob + explore_prob > 1.0:
        raise ValueError(
            f"generate_synthetic: need stay_prob, explore_prob >= 0 and stay_prob + explore_prob "
            f"<= 1; got {stay_prob}, {explore_prob}"
        )
    if isinstance(time_effect, bool) or not 0.0 <= float(time_effect) <= 1.0:
        raise ValueError(f"generate_synthetic: time_effect must be in [0, 1]; got {time_effect!r}")
    time_effect = float(time_effect)
    if mean_seq_len <= min_seq_len:
        raise ValueError(
            f"generate_synthetic: mean_seq_len ({mean_seq_len}) must exceed min_seq_len ({min_seq_len})"
        )
    if num_clusters <= 0:
        num_clusters = int(np.clip(num_items // 50, 2, 64))
    num_clusters = min(num_clusters, num_items)
    rng = np.random.default_rng(seed)
    n_users, n_items, n_clusters = int(num_users), int(num_items), int(num_clusters)

    # ---- items: clusters of equal size, Zipf popularity inside each cluster ------------------
    perm = rng.permutation(n_items)
    item_cluster = np.empty(n_items, dtype=np.int64)
    item_cluster[perm] = np.arange(n_items) % n_clusters
    # Items of cluster c sorted by popularity rank: order[cluster_start[c] : cluster_start[c+1]].
    order = perm[np.argsort(np.arange(n_items) % n_clusters, kind="stable")]
    cluster_size = np.bincount(item_cluster, minlength=n_clusters)
    cluster_start = _segment_starts(cluster_size)
    rank_in_cluster = np.arange(n_items) - np.repeat(cluster_start, cluster_size)
    weights = (rank_in_cluster + 1.0) ** -zipf_exponent
    cum = np.cumsum(weights)
    seg_tot = np.add.reduceat(weights, cluster_start)
    seg_before = cum[cluster_start] - weights[cluster_start]
    within_cum = (cum - np.repeat(seg_before, cluster_size)) / np.repeat(seg_tot, cluster_size)
    within_cum[cluster_start + cluster_size - 1] = 1.0
    # Monotone across clusters: cluster c occupies (c, c + 1], so one searchsorted serves all.
    global_cum = within_cum + np.repeat(np.arange(n_clusters, dtype=np.float64), cluster_size)
    cluster_popularity = (np.arange(n_clusters) + 1.0) ** -0.7
    cluster_popularity = rng.permutation(cluster_popularity / cluster_popularity.sum())
    item_quality = rng.normal(0.0, 1.0, n_items)

    def draw_items(clusters: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(global_cum, clusters + uniform, side="right")
        pos = np.clip(
            pos, cluster_start[clusters], cluster_start[clusters] + cluster_size[clusters] - 1
        )
        return order[pos]

    # ---- users: region-tilted sparse Dirichlet preferences, age bias, segment ----------------
    region = rng.integers(0, _NUM_REGIONS, n_users)
    age_group = rng.integers(0, _NUM_AGE_GROUPS, n_users)
    in_region = (np.arange(n_clusters)[None, :] % _NUM_REGIONS) == region[:, None]
    alpha = dirichlet_alpha + region_boost * in_region
    gam = rng.standard_gamma(alpha) + 1e-12
    user_pref = gam / gam.sum(axis=1, keepdims=True)
    top_cluster = user_pref.argmax(axis=1)
    n_segments = min(_NUM_SEGMENTS, n_clusters)
    segment = top_cluster * n_segments // n_clusters
    noisy = rng.random(n_users) < 0.1
    segment[noisy] = rng.integers(0, n_segments, int(noisy.sum()))
    age_effect = np.linspace(-1.0, 1.0, _NUM_AGE_GROUPS)
    user_bias = age_effect[age_group] + rng.normal(0.0, 0.3, n_users)

    # ---- sequence lengths: shifted lognormal, heavy right tail --------------------------------
    mu = np.log(mean_seq_len - min_seq_len) - 0.5 * seq_len_sigma**2
    lengths = min_seq_len + np.floor(rng.lognormal(mu, seq_len_sigma, n_users)).astype(np.int64)
    lengths = np.clip(lengths, min_seq_len, max_seq_len)
    offsets = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    row = np.repeat(np.arange(n_users), lengths)
    first = offsets[:-1]

    # ---- clusters: Markov chain (stay / explore / prefer), vectorised by forward fill ---------
    mode = rng.random(n)
    stay = mode < stay_prob
    stay[first] = False
    explore = (~stay) & (mode < stay_prob + explore_prob)
    long_gap = time_ruled = evergreen = regime_gaps = None
    if time_effect > 0.0:
        # Planted time effect: every step gets a gap regime; the steps it rules stay in the
        # previous item's cluster after a short gap and jump to an evergreen cluster after a
        # long one. A separate stream, so the default data keeps every draw of `rng`.
        trng = np.random.default_rng([int(seed), _TIME_STREAM])
        long_gap = trng.random(n) < _LONG_GAP_PROB
        long_gap[first] = True  # a user's first interaction follows no earlier one
        time_ruled = trng.random(n) < time_effect
        time_ruled[first] = False
        stay = np.where(time_ruled, ~long_gap, stay)
        explore = np.where(time_ruled, long_gap, explore)
        evergreen = time_ruled & long_gap
        ever_p = cluster_popularity**_EVERGREEN_SHARPNESS
        ever_cum = np.cumsum(ever_p / ever_p.sum())
        evergreen_cluster = np.minimum(
            np.searchsorted(ever_cum, trng.random(n), side="right"), n_clusters - 1
        )
        short_gaps = 1 + np.floor(trng.exponential(_SHORT_GAP_MEAN_S, n)).astype(np.int64)
        long_gaps = np.floor(
            np.exp(trng.normal(np.log(_LONG_GAP_MEDIAN_S), _LONG_GAP_SIGMA, n))
        ).astype(np.int64)
        regime_gaps = np.where(long_gap, np.maximum(long_gaps, 1), short_gaps)
    # Per-user inverse-CDF draw in one searchsorted: user u's CDF is shifted into (u, u + 1].
    pref_cum = np.cumsum(user_pref, axis=1)
    pref_cum[:, -1] = 1.0
    flat_cum = (pref_cum + np.arange(n_users, dtype=np.float64)[:, None]).reshape(-1)
    fresh = np.searchsorted(flat_cum, row + rng.random(n), side="right") - row * n_clusters
    fresh_explore = np.searchsorted(np.cumsum(cluster_popularity), rng.random(n), side="right")
    fresh = np.where(explore, fresh_explore, fresh)
    if evergreen is not None:
        fresh = np.where(evergreen, evergreen_cluster, fresh)
    fresh = np.minimum(fresh, n_clusters - 1)
    # A staying step copies the cluster of the latest non-staying step of the same user.
    last_fresh = np.maximum.accumulate(np.where(stay, 0, np.arange(n)))
    clusters = fresh[last_fresh]

    items = draw_items(clusters, rng.random(n))
    if not allow_repeats:
        # Resample later repeats of an item within a user; each round only revisits the users
        # that still have repeats.
        active = np.arange(n, dtype=np.int64)
        for round_ in range(12):
            keys = row[active] * n_items + items[active]
            _, first_idx = np.unique(keys, return_index=True)  # stable: earliest occurrence
            is_dup = np.ones(active.shape[0], dtype=bool)
            is_dup[first_idx] = False
            dup = active[is_dup]
            if dup.size == 0:
                break
            u = rng.random(dup.size)
            c = clusters[dup]
            if round_ >= 4:  # Zipf heads are exhausted: fall back to uniform within the cluster
                items[dup] = order[cluster_start[c] + (u * cluster_size[c]).astype(np.int64)]
            else:
                items[dup] = draw_items(c, u)
            users = np.unique(row[dup])
            active = _ranges(offsets[users], offsets[users + 1])

    # ---- actions: nested multi-task bitmask driven by user x item affinity --------------------
    latents = SyntheticLatents(
        item_cluster=item_cluster,
        cluster_popularity=cluster_popularity,
        user_pref=user_pref,
        user_bias=user_bias,
        item_quality=item_quality,
        affinity_scale=float(affinity_scale),
        long_gap=long_gap,
        time_ruled=time_ruled,
    )
    pref_term = latents.preference_term(row, items)
    quality = item_quality[items]
    ubias = user_bias[row]
    # returning after a long gap makes acting likelier (less likely for "dislike")
    gap_term = None if long_gap is None else time_effect * long_gap
    fired = np.zeros((n, num_tasks), dtype=bool)
    for k in range(num_tasks):
        if k < len(_TASK_SPECS):
            parent, need, w_pref, w_q, w_u, b = _TASK_SPECS[k]
        else:  # extra generic tasks: gated on click, rarer and rarer
            parent, need, w_pref, w_q, w_u, b = 0, 1, 1.0, 0.5, 0.5, -1.0 - 0.25 * k
        logit = w_pref * pref_term + w_q * quality + w_u * ubias + b
        if gap_term is not None:
            logit = logit + np.sign(w_pref) * gap_term
        fire = rng.random(n) < 1.0 / (1.0 + np.exp(-logit))
        if parent >= 0:
            fire &= fired[:, parent] == bool(need)
        fired[:, k] = fire
    actions = (fired.astype(np.int64) << np.arange(num_tasks, dtype=np.int64)).sum(axis=1)

    # ---- timestamps: per-user start + strictly positive gaps ---------------------------------
    gaps = 1 + np.floor(rng.exponential(3600.0, n)).astype(np.int64)
    gaps[first] = _BASE_TIME + rng.integers(0, 90 * 86400, n_users)
    if regime_gaps is not None:  # the planted time effect's gaps (same start times)
        regime_gaps[first] = gaps[first]
        gaps = regime_gaps
    csum = np.cumsum(gaps)
    timestamps = csum - np.repeat(csum[first] - gaps[first], lengths)

    action_names = [
        SYNTHETIC_ACTION_NAMES[k] if k < len(SYNTHETIC_ACTION_NAMES) else f"task_{k}"
        for k in range(num_tasks)
    ]
    user_ids = np.arange(n_users, dtype=np.int64)
    user_features = np.stack([user_ids, segment, age_group, region], axis=1).astype(np.int64)
    data = SequenceData(
        name=name,
        user_ids=user_ids,
        offsets=offsets,
        item_ids=items.astype(np.int64),
        actions=actions,
        timestamps=timestamps.astype(np.int64),
        user_features=user_features,
        user_feature_names=list(SYNTHETIC_FEATURE_NAMES),
        action_names=action_names,
        extra={
            "generator": "hstu.data.synthetic",
            "seed": int(seed),
            "num_items_requested": n_items,
            "num_clusters": n_clusters,
            **({"time_effect": time_effect} if time_effect > 0.0 else {}),
        },
    )
    logger.debug("synthetic data: %d users, %d interactions, %d clusters", n_users, n, n_clusters)
    return data, latents


def generate_synthetic(
    num_users: int, num_items: int, seed: int, num_tasks: int = 8, **kwargs
) -> SequenceData:
    """Deterministic synthetic ``SequenceData`` with planted signal (see module docstring).

    Keyword arguments are those of :func:`generate_synthetic_with_latents`.
    """
    data, _ = generate_synthetic_with_latents(num_users, num_items, seed, num_tasks, **kwargs)
    return data
