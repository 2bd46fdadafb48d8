"""Issue 29: every rollout-correction rule and loss aggregation against a float64 reference written in
plain Python from its published definition (verl's rollout_is / rollout_rs, TRL's importance-sampling
modes and OPSM, IcePop, the Sparrow recipe's stochastic rejection and alpha reweighting), on one fixed
batch: the weights, the kept tokens, the loss and its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow.stages.train import LossConfig, policy_loss, rollout_correction
from sparrow.stages.train.corrections import RS_OPTIONS
from sparrow.stages.train.objective import loss_normalizer

B = 20.0  # verl's safety bound on log r


def clamp(x: float) -> float:
    return max(-B, min(B, x))


def batch(seed: int = 0):
    """6 sequences of lengths 7, 3, 5, 1, 6, 7 (float64): ratios spread around 1, one tiny ratio."""
    n, t = 6, 7
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5, 1, 6, 7]
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    logp_old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp_new = logp_old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4
    log_ratio = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.6
    log_ratio[2, 1] = -12.0
    log_ratio[1, 0] = 1.9
    adv = torch.tensor([1.3, -0.7, -0.4, -1.9, -0.2, 2.1], dtype=torch.float64)
    alpha = torch.rand(n, t, generator=g, dtype=torch.float64) * 0.5 + 0.5
    return logp_new, logp_old, log_ratio, adv, mask, alpha


def reference_rules(lr, mask, adv=None, alpha=None, u=None, *, is_level=None, upper=2.0, lower=None,
                    mode="truncate", normalize=False, rs=(), veto=None, opsm=None, rejection=None, c=1.0):
    """(keep, weights) as lists, token by token from the definitions."""
    n, t = len(lr), len(lr[0])
    valid = lambda i: [j for j in range(t) if mask[i][j]]
    keep = [[bool(mask[i][j]) for j in range(t)] for i in range(n)]
    drop = lambda i: keep.__setitem__(i, [False] * t)
    for i in range(n):
        if veto is not None and any(math.exp(clamp(lr[i][j])) < veto for j in valid(i)):
            drop(i)
        if opsm is not None and valid(i) and adv[i] < 0:
            if sum(-lr[i][j] for j in valid(i)) / len(valid(i)) > opsm:
                drop(i)
    for option, up, lo in rs:
        level, k = option.rsplit("_", 1)
        stat = {"k1": lambda x: -clamp(x), "k2": lambda x: 0.5 * clamp(x) ** 2,
                "k3": lambda x: math.exp(clamp(x)) - 1 - clamp(x)}[k]
        if k == "k1":
            low = lo if lo is not None else 1 / up
            ok = lambda s, low=low, up=up: math.log(low) <= -s <= math.log(up)
        else:
            ok = lambda s, up=up: s <= up
        for i in range(n):
            vals = [stat(lr[i][j]) for j in valid(i)]
            if level == "token":
                for j in valid(i):
                    keep[i][j] = keep[i][j] and ok(stat(lr[i][j]))
            elif vals:
                agg = {"seq_sum": sum(vals), "seq_mean": sum(vals) / len(vals), "seq_max": max(vals)}[level]
                if not ok(agg):
                    drop(i)
    if rejection == "token":
        for i in range(n):
            for j in valid(i):
                keep[i][j] = keep[i][j] and u[i][j] < min(1.0, math.exp(clamp(lr[i][j])) / c)
    elif rejection == "sequence":
        for i in range(n):
            if valid(i):
                g = math.exp(sum(clamp(lr[i][j]) for j in valid(i)) / len(valid(i)))
                if not u[i] < min(1.0, g / c):
                    drop(i)
    w = [[1.0] * t for _ in range(n)]
    if is_level is not None:
        for i in range(n):
            seq = math.exp(clamp(sum(lr[i][j] for j in valid(i))))
            for j in valid(i):
                x = math.exp(clamp(lr[i][j])) if is_level == "token" else seq
                if mode == "truncate":
                    w[i][j] = min(max(x, lower if lower is not None else -math.inf), upper)
                else:
                    w[i][j] = x if (lower or 0.0) <= x <= upper else 0.0
    if alpha is not None:
        w = [[w[i][j] * alpha[i][j] for j in range(t)] for i in range(n)]
    if normalize:
        if is_level == "sequence":
            seqs = [sum(w[i][j] for j in range(t) if keep[i][j]) / sum(keep[i])
                    for i in range(n) if any(keep[i])]
            mean = sum(seqs) / len(seqs)
        else:
            kept = [w[i][j] for i in range(n) for j in range(t) if keep[i][j]]
            mean = sum(kept) / len(kept)
        w = [[x / mean for x in row] for row in w]
    w = [[w[i][j] if keep[i][j] else 0.0 for j in range(t)] for i in range(n)]
    return keep, w


def reference_loss(logp_new, logp_old, adv, keep, w, agg="token-mean", max_tokens=None, micro=None,
                   clip_low=0.2, clip_high=0.28, dual=3.0):
    """The clipped loss over kept tokens, aggregated as `agg` (bnpo: micro-batches of `micro`)."""
    n, t = len(logp_new), len(logp_new[0])

    def token(i, j):
        ratio = math.exp(logp_new[i][j] - logp_old[i][j])
        a = adv[i]
        pg = max(-a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high))
        if a < 0:
            pg = min(pg, -a * dual)
        return pg * w[i][j]

    terms = [[token(i, j) if keep[i][j] else 0.0 for j in range(t)] for i in range(n)]
    if agg == "token-mean":
        return sum(map(sum, terms)) / sum(map(sum, keep))
    if agg == "seq-mean-token-mean":
        seqs = [sum(terms[i]) / sum(keep[i]) for i in range(n) if any(keep[i])]
        return sum(seqs) / len(seqs)
    if agg == "seq-mean-token-sum-norm":
        return sum(map(sum, terms)) / (n * max_tokens)
    parts = [range(s, min(s + micro, n)) for s in range(0, n, micro)]  # bnpo
    means = [sum(sum(terms[i]) for i in p) / max(sum(sum(keep[i]) for i in p), 1) for p in parts]
    return sum(means) / len(parts)


def L(x):
    return x.tolist()


CASES = {  # LossConfig options -> reference_rules options
    "seq-tis": (dict(correction="none", rollout_is="sequence", rollout_is_threshold="2.0"),
                dict(is_level="sequence", upper=2.0)),
    "seq-tis-clip-min": (dict(correction="none", rollout_is="sequence", rollout_is_threshold="0.5_3.0"),
                         dict(is_level="sequence", lower=0.5, upper=3.0)),
    "token-mask (TRL)": (dict(correction="none", rollout_is="token", rollout_is_mode="mask",
                              rollout_is_threshold="1.5"), dict(is_level="token", mode="mask", upper=1.5)),
    "seq-mask (TRL)": (dict(correction="none", rollout_is="sequence", rollout_is_mode="mask",
                            rollout_is_threshold="3.0"), dict(is_level="sequence", mode="mask", upper=3.0)),
    "icepop": (dict(correction="icepop"), dict(is_level="token", mode="mask", lower=0.5, upper=5.0)),
    "token-tis-batch-norm": (dict(correction="tis", rollout_is_batch_normalize=True),
                             dict(is_level="token", upper=2.0, normalize=True)),
    "seq-is-batch-norm": (dict(correction="none", rollout_is="sequence", rollout_is_threshold="4.0",
                               rollout_is_batch_normalize=True),
                          dict(is_level="sequence", upper=4.0, normalize=True)),
    "seq-mask-tis": (dict(correction="seq-mask-tis"),
                     dict(is_level="token", upper=2.0, rs=(("seq_mean_k1", 2.0, 0.5),))),
    "geo-mean filter tight": (dict(correction="none", rollout_rs="seq_mean_k1",
                                   rollout_rs_threshold="0.8_1.25"), dict(rs=(("seq_mean_k1", 1.25, 0.8),))),
    "combined rs": (dict(correction="tis", rollout_rs="token_k1,seq_max_k2",
                         rollout_rs_threshold="0.6_1.6,1.0"),
                    dict(is_level="token", upper=2.0,
                         rs=(("token_k1", 1.6, 0.6), ("seq_max_k2", 1.0, None)))),
    "veto": (dict(correction="veto"), dict(veto=1e-4)),
    "opsm": (dict(correction="opsm"), dict(opsm=0.5)),
    "opsm-0.1+tis": (dict(correction="tis", off_policy_mask_threshold=0.1),
                     dict(is_level="token", upper=2.0, opsm=0.1)),
    "sparse-rl": (dict(correction="sparse-rl"),
                  dict(veto=1e-4, rs=(("token_k1", 1.5, 0.5),), is_level="token", upper=1.5, normalize=True)),
}
RS_THRESHOLDS = {"k1": "0.7_1.5", "k2": "0.4", "k3": "0.5"}
for _opt in RS_OPTIONS:
    _lo, _up = (0.7, 1.5) if _opt.endswith("k1") else (None, float(RS_THRESHOLDS[_opt[-2:]]))
    if _opt.startswith("seq_sum"):
        _lo, _up = (0.3, 3.0) if _opt.endswith("k1") else (None, 3 * _up)
    _text = f"{_lo}_{_up}" if _lo is not None else str(_up)
    CASES[f"rs {_opt}"] = (dict(correction="none", rollout_rs=_opt, rollout_rs_threshold=_text),
                           dict(rs=((_opt, _up, _lo),)))


def check_against_reference(cfg: LossConfig, corr, ref_keep, ref_w, agg="token-mean", logp_old=None,
                            micro=None, max_tokens=None):
    logp_new, old, _, adv, mask, _ = batch()
    logp_old = old if logp_old is None else logp_old
    assert L(corr.mask) == ref_keep
    assert (corr.weights - torch.tensor(ref_w, dtype=torch.float64)).abs().max() < 1e-12
    keep = corr.mask

    def ours(x):
        if agg == "bnpo":
            total = 0
            n_micro = math.ceil(len(x) / micro)
            for s in range(0, len(x), micro):
                sl = slice(s, s + micro)
                norm = loss_normalizer(keep[sl], cfg) * n_micro
                total = total + policy_loss(x[sl], logp_old[sl], adv[sl], corr.weights[sl], keep[sl], cfg,
                                            normalizer=norm)[0]
            return total
        norm = loss_normalizer(keep, cfg, max_tokens)
        return policy_loss(x, logp_old, adv, corr.weights, keep, cfg, normalizer=norm)[0]

    x = logp_new.clone().requires_grad_(True)
    loss = ours(x)
    loss.backward()
    want = lambda lp: reference_loss(L(lp), L(logp_old), L(adv), ref_keep, ref_w, agg, max_tokens, micro)
    assert abs(float(loss.detach()) - want(logp_new)) < 1e-12
    h = 1e-6
    for i, j in [(0, 0), (0, 6), (1, 2), (3, 0), (4, 4), (5, 3), (2, 0)]:
        plus, minus = logp_new.clone(), logp_new.clone()
        plus[i, j] += h
        minus[i, j] -= h
        assert abs(float(x.grad[i, j]) - (want(plus) - want(minus)) / (2 * h)) < 1e-6, (i, j)


@pytest.mark.parametrize("name", CASES)
def test_rule_matches_float64_reference(name):
    options, ref = CASES[name]
    _, _, lr, adv, mask, _ = batch()
    cfg = LossConfig(**options).validate()
    corr = rollout_correction(lr, mask, cfg, advantages=adv)
    keep, w = reference_rules(L(lr), L(mask), L(adv), **ref)
    assert sum(map(sum, keep)) > 0  # the case keeps something: the loss is not trivially 0
    check_against_reference(cfg, corr, keep, w)


def test_rs_cases_reject_something_and_keep_something():
    """Each threshold above bites on the batch: some tokens go, some stay (else the test is idle)."""
    _, _, lr, adv, mask, _ = batch()
    for name, (options, _) in CASES.items():
        corr = rollout_correction(lr, mask, LossConfig(**options).validate(), advantages=adv)
        changed = bool((corr.mask != mask).any()) or bool((corr.weights[mask] != 1).any())
        assert changed and bool(corr.mask.any()), name


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_stochastic_rejection_and_alpha_weighting_match_reference(level):
    """The Sparrow recipe: keep with probability min(1, r / C) (per token, or per sequence on its geometric
    mean ratio), token IS truncated at 2, weights times alpha; the draws are those of a generator seeded
    with the same number, so the same seed rejects the same tokens."""
    _, _, lr, adv, mask, alpha = batch()
    cfg = LossConfig(correction="sparrow", rejection=level, rejection_c=0.9).validate()
    corr = rollout_correction(lr, mask, cfg, alpha=alpha, generator=torch.Generator().manual_seed(7))
    shape = mask.shape if level == "token" else mask.shape[:1]
    u = torch.rand(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    keep, w = reference_rules(L(lr), L(mask), alpha=L(alpha), u=L(u), is_level="token", upper=2.0,
                              rejection=level, c=0.9)
    assert 0 < sum(map(sum, keep)) < int(mask.sum())
    check_against_reference(cfg, corr, keep, w)
    again = rollout_correction(lr, mask, cfg, alpha=alpha, generator=torch.Generator().manual_seed(7))
    assert torch.equal(again.mask, corr.mask) and torch.equal(again.weights, corr.weights)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "dr_grpo", "bnpo", "seq-mean-token-sum-norm", "dapo"])
def test_aggregations_match_reference(agg):
    _, _, lr, adv, mask, _ = batch()
    cfg = LossConfig(correction="mis", loss_agg=agg).validate()
    corr = rollout_correction(lr, mask, cfg)
    keep, w = reference_rules(L(lr), L(mask), rs=(("token_k1", 2.0, 0.5),))
    check_against_reference(cfg, corr, keep, w, agg=cfg.aggregation, micro=4, max_tokens=10)


def test_bypass_takes_the_ratio_against_the_rollout_logprobs():
    logp_new, logp_old, lr, adv, mask, _ = batch()
    cfg = LossConfig(correction="none", bypass_mode=True).validate()
    corr = rollout_correction(lr, mask, cfg)
    keep, w = reference_rules(L(lr), L(mask))
    check_against_reference(cfg, corr, keep, w, logp_old=logp_old - lr)  # logp_rollout


def test_every_rule_is_a_no_op_when_the_ratios_are_one():
    """r_t = 1 everywhere (the dense sampler): every token kept with weight 1 (alpha 1), so the loss is
    the uncorrected one."""
    _, _, lr, adv, mask, _ = batch()
    ones = torch.zeros_like(lr)
    for name, (options, _) in CASES.items():
        cfg = LossConfig(**options).validate()
        corr = rollout_correction(ones, mask, cfg, advantages=adv)
        assert torch.equal(corr.mask, mask) and (corr.weights[mask] - 1).abs().max() < 1e-12, name
    corr = rollout_correction(ones, mask, LossConfig(correction="sparrow").validate(),
                              alpha=torch.ones_like(lr), generator=torch.Generator().manual_seed(0))
    assert torch.equal(corr.mask, mask) and bool((corr.weights[mask] == 1).all())


@pytest.mark.parametrize("bad,message", [
    (dict(rollout_is="tokens"), "--rollout-is must be one of token, sequence, none"),
    (dict(rollout_is_threshold="2_1"), "L < U"),
    (dict(rollout_is_threshold="abc"), "--rollout-is-threshold must be a positive number"),
    (dict(rollout_rs="token_k4"), "--rollout-rs must be a comma list of"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "bounds its statistic from above"),
    (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1.5,2,3"), r"one per option \(2\)"),
    (dict(rollout_rs_threshold="2.0"), "needs --rollout-rs"),
    (dict(rejection="batch"), "--rejection must be one of"),
    (dict(off_policy_mask_threshold=0.0), "must be positive"),
    (dict(loss_agg="sum"), "--loss-agg must be one of"),
])
def test_bad_options_are_refused_in_one_sentence(bad, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**bad).validate()


def test_off_policy_metrics_match_reference():
    """verl's off-policy diagnostics from their definitions, per token and per sequence, in float64."""
    from sparrow.stages.train.corrections import off_policy_metrics

    logp_new, logp_old, lr, _, mask, _ = batch()
    logp_rollout = logp_old - lr
    got = off_policy_metrics(logp_old, logp_rollout, mask)
    old, roll, m = L(logp_old), L(logp_rollout), L(mask)
    toks = [(old[i][j], roll[i][j]) for i in range(6) for j in range(7) if m[i][j]]
    seqs = [[(old[i][j], roll[i][j]) for j in range(7) if m[i][j]] for i in range(6)]
    mean = lambda xs: sum(xs) / len(xs)
    r = lambda o, q: math.exp(clamp(o - q))
    diff = [mean([q for _, q in s]) - mean([o for o, _ in s]) for s in seqs]
    want = {"kl": mean([q - o for o, q in toks]),
            "k3_kl": mean([r(o, q) - 1 - clamp(o - q) for o, q in toks]),
            "training_ppl": mean([math.exp(-mean([o for o, _ in s])) for s in seqs]),
            "rollout_ppl": mean([math.exp(-mean([q for _, q in s])) for s in seqs]),
            "ppl_ratio": mean([math.exp(d) for d in diff]), "log_ppl_diff": mean(diff),
            "log_ppl_abs_diff": mean([abs(d) for d in diff]), "log_ppl_diff_max": max(diff),
            "log_ppl_diff_min": min(diff), "chi2_token": mean([r(o, q) ** 2 for o, q in toks]) - 1,
            "chi2_seq": mean([math.exp(2 * clamp(sum(o - q for o, q in s))) for s in seqs]) - 1}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k


def test_is_metrics_match_reference():
    """is_bounded_* (the weights the loss reads): min(r, 2) over tokens (token IS) and the sequence
    weights (sequence IS), their effective sample size, and the unbounded ratio's fractions above U and
    below 1/U."""
    from sparrow.stages.train.corrections import metrics

    _, logp_old, lr, adv, mask, _ = batch()
    for level in ("token", "sequence"):
        cfg = LossConfig(correction="none", rollout_is=level).validate()
        corr = rollout_correction(lr, mask, cfg, advantages=adv)
        got = metrics(corr, lr, logp_old, logp_old - lr, mask, cfg.rules())
        rows_ = [[x for x, k in zip(row, keep) if k] for row, keep in zip(L(lr), L(mask))]
        if level == "token":
            logs = [x for row in rows_ for x in row]
        else:
            logs = [sum(row) for row in rows_]
        w = [min(math.exp(clamp(x)), 2.0) for x in logs]
        mean = sum(w) / len(w)
        assert got["rollout_corr/is_bounded_mean"] == pytest.approx(mean, rel=1e-12)
        assert got["rollout_corr/is_bounded_max"] == pytest.approx(max(w), rel=1e-12)
        assert got["rollout_corr/is_bounded_std"] == pytest.approx(
            math.sqrt(sum((x - mean) ** 2 for x in w) / len(w)), rel=1e-12)
        assert got["rollout_corr/is_bounded_eff_sample_size"] == pytest.approx(
            1 / (sum((x / mean) ** 2 for x in w) / len(w)), rel=1e-12)
        assert got["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(
            sum(x > math.log(2) for x in logs) / len(logs))
        assert got["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(
            sum(x < math.log(0.5) for x in logs) / len(logs))
