"""Synthetic chains for tests, benchmarks and README examples (no profile needed)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import PlannerArgumentError
from .chain import Chain, Layer, Option, Post, Pre


def uniform_chain(n: int, *, x_bytes: int, xbar_bytes: int | None = None, fwd_ms: float = 1.0,
                  bwd_ms: float = 2.0, persistent_bytes: int = 0, grad_bytes: int = 0) -> Chain:
    """``n`` identical layers with no transients, a free pre and post (the article's example)."""
    xbar = x_bytes if xbar_bytes is None else xbar_bytes
    layers = tuple(Layer(f"layer{i}", fwd_ms, bwd_ms, x_bytes, xbar, 0, 0, grad_bytes)
                   for i in range(n))
    return Chain(layers, Pre(x_bytes), Post(0), x_in_bytes=x_bytes, delta_in_bytes=0,
                 persistent_bytes=persistent_bytes, opt_step_peak_bytes=persistent_bytes)


def random_chain(n: int, seed: int | np.random.Generator = 0, *, scale: int = 1,
                 max_size: int = 20, options: int = 0) -> Chain:
    """Heterogeneous layers with integer sizes in units of ``scale`` bytes (small ints keep the
    DP exact, which is what brute-force tests need). ``options`` > 0 adds that many selective
    options per layer (``with_options``, drawn from the same generator)."""
    rng = np.random.default_rng(seed)

    def r(lo: int, hi: int) -> int:
        return int(rng.integers(lo, hi + 1)) * scale

    layers = []
    for i in range(n):
        x = r(1, max_size)
        layers.append(Layer(f"layer{i}", float(rng.uniform(0.5, 5.0)), float(rng.uniform(1.0, 10.0)),
                            x, x + r(0, 2 * max_size), r(0, max_size // 2), r(0, max_size // 2),
                            r(0, max_size // 2)))
    x_in = r(1, max_size)
    persistent = r(0, 5 * max_size)
    post = Post(r(0, max_size), r(0, max_size // 2), r(0, max_size // 2), r(0, max_size // 2),
                float(rng.uniform(0.5, 2.0)), float(rng.uniform(0.5, 2.0)))
    pre = Pre(x_in + r(0, max_size), r(0, max_size // 2), r(0, max_size // 2), r(0, max_size // 2),
              float(rng.uniform(0.1, 1.0)), float(rng.uniform(0.1, 1.0)))
    delta_in = x_in if rng.random() < 0.5 else 0
    chain = Chain(tuple(layers), pre, post, x_in_bytes=x_in, delta_in_bytes=delta_in,
                  persistent_bytes=persistent, opt_step_peak_bytes=persistent + r(0, 3 * max_size))
    return with_options(chain, rng, options=options) if options else chain


OPTION_NAMES = ("sac-a", "sac-b", "sac-c", "sac-d")


def with_options(chain: Chain, seed: int | np.random.Generator = 0, *, options: int = 2,
                 share: float = 1.0) -> Chain:
    """``chain`` with ``options`` selective options on about ``share`` of its layers, named
    ``sac-a``, ``sac-b``, ... on every such layer: each keeps between the output and about the
    whole ``xbar`` (sometimes more), with its own transients (the backward's usually larger:
    recomputed tensors live there) and a recompute of up to the layer's forward time. Sizes are
    arbitrary integers, so they rarely divide evenly."""
    if not 0 < options <= len(OPTION_NAMES):
        raise PlannerArgumentError(f"options must be in 1..{len(OPTION_NAMES)}, got {options}")
    rng = np.random.default_rng(seed)
    out = []
    for ly in chain.layers:
        if rng.random() >= share:
            out.append(replace(ly, options=()))
            continue
        extra = ly.xbar_bytes - ly.x_bytes
        opts = []
        for name in OPTION_NAMES[:options]:
            keep = int(rng.integers(0, int(extra * 1.1) + 2))
            opts.append(Option(name, ly.x_bytes + keep, float(rng.uniform(0.0, 1.0)) * ly.fwd_ms,
                               int(rng.integers(0, ly.fwd_tmp_bytes + 2)),
                               int(rng.integers(0, max(1, ly.bwd_tmp_bytes + extra - keep + 2)))))
        out.append(replace(ly, options=tuple(opts)))
    return replace(chain, layers=tuple(out))


def with_tails(chain: Chain, seed: int | np.random.Generator = 0, *, most: float = 0.5) -> Chain:
    """``chain`` with a ``tail_ms`` on every layer, up to ``most`` of its forward: what a
    checkpoint ending at the layer does not redo (PyTorch's early stop)."""
    rng = np.random.default_rng(seed)
    return replace(chain, layers=tuple(replace(ly, tail_ms=float(rng.uniform(0.0, most)) * ly.fwd_ms)
                                       for ly in chain.layers))


def with_casts(chain: Chain, seed: int | np.random.Generator = 0, *, share: float = 0.8) -> Chain:
    """``chain`` with autocast copies on about ``share`` of its layers, each at most what the
    layer keeps besides its output (a stored layer's copies are inside its ``xbar``); its options
    hold a part of them, drawn, until the forward ends, and so does the layer stored, for about
    half of the layers (``unsaved_cast_bytes``: a bias's copy), and pre for about half the chains."""
    rng = np.random.default_rng(seed)
    layers = []
    for ly in chain.layers:
        cast = int(rng.integers(0, ly.xbar_bytes - ly.x_bytes + 1)) if rng.random() < share else 0
        # an option keeps some of them (in its xbar) and holds the rest to the forward's end
        opts = tuple(replace(o, cast_bytes=int(rng.integers(0, cast + 1))) for o in ly.options)
        unsaved = int(rng.integers(0, cast // 4 + 1)) if rng.random() < 0.5 else 0
        layers.append(replace(ly, cast_bytes=cast, unsaved_cast_bytes=unsaved, options=opts))
    pre_cast = int(rng.integers(1, chain.x_in_bytes + 2)) if rng.random() < 0.5 else 0
    return replace(chain, layers=tuple(layers), pre=replace(chain.pre, cast_bytes=pre_cast))


def with_loss(chain: Chain, seed: int | np.random.Generator = 0, *, most: int = 20) -> Chain:
    """``chain`` with a loss tensor of up to ``most`` bytes (``Post.loss_bytes``): it and its
    gradient seed are live through the whole backward, recomputes included."""
    rng = np.random.default_rng(seed)
    return replace(chain, post=replace(chain.post, loss_bytes=int(rng.integers(1, most + 1))))


def with_early(chain: Chain, seed: int | np.random.Generator = 0, *, share: float = 0.8) -> Chain:
    """``chain`` with early-stop sizes on about ``share`` of its layers (``Layer.early_*``): a
    recompute ending with the layer stored stops at its last saved tensor, keeping between 0
    and ``xbar`` with a peak up to the whole forward's."""
    rng = np.random.default_rng(seed)

    def early(ly):
        if ly.in_place or rng.random() >= share:
            return ly
        ex = int(rng.integers(0, ly.xbar_bytes + 1))
        et = int(rng.integers(0, ly.xbar_bytes + ly.fwd_tmp_bytes - ex + 1))
        return replace(ly, early_xbar_bytes=ex, early_fwd_tmp_bytes=et)
    return replace(chain, layers=tuple(early(ly) for ly in chain.layers))


def with_holds(chain: Chain, seed: int | np.random.Generator = 0, *, most: int = 10) -> Chain:
    """``chain`` with held layers (``Layer.held_bytes``, FSDP2 per rank): held bytes, an
    all-gather buffer and a retained backward output of up to ``most`` bytes each, held
    transients (its options' too) of up to the plain ones."""
    rng = np.random.default_rng(seed)

    def r(hi: int) -> int:
        return int(rng.integers(0, hi + 1))

    def held(ly):
        return replace(ly, held_bytes=r(most), gather_bytes=r(most), retained_bytes=r(most),
                       held_fwd_tmp_bytes=r(ly.fwd_tmp_bytes), held_bwd_tmp_bytes=r(ly.bwd_tmp_bytes),
                       options=tuple(replace(o, held_fwd_tmp_bytes=r(o.fwd_tmp_bytes),
                                             held_bwd_tmp_bytes=r(o.bwd_tmp_bytes))
                                     for o in ly.options))
    return replace(chain, layers=tuple(held(ly) for ly in chain.layers))


def long_run_chain(n: int, seed: int = 0, *, options: int = 0, size: int = 1_000_003) -> Chain:
    """``random_chain(n, seed, max_size=size)`` with a run of 20 to 79 consecutive layers (at
    most ``n - 3``) that are cheap to recompute (2-50% of their time) and keep about ``size``
    bytes each but pass on only 5-50% of that, followed by a layer whose backward needs 20-80%
    of the whole run's bytes more (and takes 3x as long). Near the smallest peak the best plan
    wraps most of the run in one top-level checkpoint longer than 16 layers with short
    checkpoints inside (a chain whose best checkpoint is longer than ``limits.BAND_START``).
    ``options`` > 0 then adds that many selective options per layer (``with_options``)."""
    rng = np.random.default_rng(4000 + seed)
    base = random_chain(n, seed, max_size=size)
    layers = list(base.layers)
    run = int(rng.integers(20, min(80, n - 2)))
    start = int(rng.integers(0, n - run))
    out_share = float(rng.choice([0.05, 0.2, 0.5]))
    big = float(rng.uniform(0.2, 0.8))
    cheap = float(rng.choice([0.02, 0.1, 0.5]))
    for i in range(start, start + run):
        ly = layers[i]
        x = int(size * out_share * rng.uniform(0.9, 1.1))
        keep = int(size * rng.uniform(0.9, 1.1))
        layers[i] = replace(ly, x_bytes=x, xbar_bytes=max(x, keep), fwd_tmp_bytes=size // 10,
                            bwd_tmp_bytes=size // 10, fwd_ms=ly.fwd_ms * cheap,
                            bwd_ms=ly.bwd_ms * cheap)
    if start + run < n:
        ly = layers[start + run]
        layers[start + run] = replace(ly, bwd_tmp_bytes=int(big * run * size), fwd_ms=3 * ly.fwd_ms,
                                      bwd_ms=3 * ly.bwd_ms)
    chain = replace(base, layers=tuple(layers))
    return with_options(chain, seed, options=options) if options else chain
