"""The step's records and parts that need no training loop (pepo.training.step): the rollout
dump's records, the step's metrics, the closing lines, and the policy forward."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pepo.training.generation import Rollouts, pad_prompts
from pepo.training.step import (
    StepStats,
    Trajectory,
    by_length,
    closing_summary,
    dump_records,
    mean_abs_change,
    policy_logprobs,
    row_extent,
    saves_logits,
    step_metrics,
    weigh_from_update,
)


def _trajectory() -> Trajectory:
    """4 rollouts of 2 prompts; this rank holds rows 2-3 (the second prompt), with lengths 3
    and 1 of T = 3. Numbers chosen so that every metric is a small exact fraction."""
    mask = torch.tensor([[True, True, True], [True, False, False]])
    ro = Rollouts(prompt_tokens=torch.zeros(2, 1, dtype=torch.long),
                  prompt_mask=torch.ones(2, 1, dtype=torch.bool),
                  tokens=torch.tensor([[5, 6, 7], [8, 0, 0]]), mask=mask,
                  finished=torch.tensor([False, True]),
                  logprobs=torch.tensor([[-1.0, -2.0, -0.5], [-0.25, 9.0, 9.0]]))
    problems = [SimpleNamespace(id="q", prompt="2+2", answer="4")] * 2
    return Trajectory(
        prompt_ids=["p", "p", "q", "q"], problems=problems, part=slice(2, 4), rollouts=ro,
        texts=["abc", "d"], rewards=torch.tensor([1.0, 0.0]),
        rewards_all=torch.tensor([0.0, 0.0, 1.0, 0.0]),
        advantages_all=torch.tensor([0.0, 0.0, 0.5, -0.5]),
        success_all=torch.tensor([False, False, True, False]),
        old_logprobs=torch.tensor([[-1.5, -2.0, -0.25], [-0.25, 7.0, 7.0]]),
        entropies=torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 50.0]]),
        token_advantages=torch.tensor([[0.25, 0.5, 0.75], [-0.5, 0.0, 0.0]]))


def test_dump_records_hold_the_strategys_inputs_and_output_of_valid_tokens():
    """Catches padding in a record, the whole batch's advantage instead of this rank's row,
    and token weights divided by a zero advantage."""
    traj = _trajectory()
    recs = dump_records(traj, step=7, strategy="s", id_to_token=lambda t: f"<{t}>")
    assert [r["tokens"] for r in recs] == [["<5>", "<6>", "<7>"], ["<8>"]]
    assert recs[0]["entropies"] == [1.0, 2.0, 3.0] and recs[1]["entropies"] == [4.0]
    assert [r["advantage"] for r in recs] == [0.5, -0.5]
    assert [r["success"] for r in recs] == [True, False]
    assert [r["reward"] for r in recs] == [1.0, 0.0]
    assert recs[0]["token_weights"] == [0.5, 1.0, 1.5] and recs[1]["token_weights"] == [1.0]
    assert {r["step"] for r in recs} == {7} and recs[1]["response"] == "d"
    assert [r["group"] for r in recs] == [None, None]
    traj.groups = torch.tensor([3, 4])  # two groups of one prompt: the dump tells them apart
    assert [r["group"] for r in dump_records(traj, step=7, strategy="s", id_to_token=str)] == [
        3, 4]
    traj.advantages_all = torch.tensor([0.0, 0.0, 0.0, -0.5])
    assert dump_records(traj, step=7, strategy="s", id_to_token=str)[0]["token_weights"] is None


class _OneRank:
    def sum(self, t):
        return t

    def max(self, t):
        return t


def test_step_metrics_against_hand_sums():
    """Each metric from the arithmetic in the comments (one rank). Catches a mean over padding,
    a per-rank instead of whole-batch denominator, and gaps taken at padding (9 vs 7 there)."""
    traj = _trajectory()
    stats = StepStats(losses=[torch.tensor(0.5), torch.tensor(1.5)],
                      grad_norms=[torch.tensor(1.0), torch.tensor(3.0)],
                      clip_fraction=1.0, approx_kl=0.5, tokens=4.0, drift=0.125,
                      times={"gen_time": 1.0, "logprob_time": 2.0, "update_time": 3.0})
    m = step_metrics(traj, stats, _OneRank(), lr=0.01, nonfinite_skipped=2, step_time=8.0)
    assert m["reward"] == 0.25 and m["accuracy"] == 0.25  # [0, 0, 1, 0]
    assert m["loss"] == 1.0 and m["grad_norm"] == 2.0 and m["grad_norm_max"] == 3.0
    assert m["entropy"] == (1 + 2 + 3 + 4) / 4  # valid tokens only
    assert m["response_len"] == 4 / 4  # 4 valid tokens over the whole batch's 4 rows
    assert m["truncated"] == 1 / 4  # one unfinished row of 4
    assert m["zero_advantage"] == 2 / 4
    assert m["clip_fraction"] == 1.0 / 4 and m["approx_kl"] == 0.5 / 4
    assert m["rollout_logprob_gap"] == (0.5 + 0 + 0.25 + 0) / 4
    assert m["rollout_logprob_gap_max"] == 0.5
    assert m["tokens_per_s"] == 4 / 8.0 and m["step_time"] == 8.0
    assert (m["gen_time"], m["logprob_time"], m["update_time"]) == (1.0, 2.0, 3.0)
    assert m["policy_drift"] == 0.125 and m["nonfinite_skipped"] == 2 and m["lr"] == 0.01
    stats.drift = None
    assert "policy_drift" not in step_metrics(traj, stats, _OneRank(), lr=0.01,
                                              nonfinite_skipped=0, step_time=1.0)


def test_token_means_and_row_means_have_their_own_denominators():
    """The fixture above has as many valid tokens as rows (4 and 4), so a mean taken over the
    wrong one passes there. Here 5 valid tokens over the batch's 4 rows: the entropy is the
    mean over the tokens, 3.0 (catches it divided by the rows: 3.75, the mean entropy times the
    mean length), and the response length the mean over the rows, 5/4 (catches it divided by
    the tokens: 1.0)."""
    traj = _trajectory()
    ro = traj.rollouts
    ro.mask = torch.tensor([[True, True, True], [True, True, False]])
    ro.tokens = torch.tensor([[5, 6, 7], [8, 9, 0]])
    ro.logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -1.0, 9.0]])
    traj.old_logprobs = torch.tensor([[-1.5, -2.0, -0.25], [-0.25, -1.0, 7.0]])
    traj.entropies = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 50.0]])
    traj.token_advantages = torch.tensor([[0.25, 0.5, 0.75], [-0.5, -0.5, 0.0]])
    stats = StepStats(losses=[torch.tensor(1.0)], grad_norms=[torch.tensor(1.0)],
                      clip_fraction=0.0, approx_kl=0.0, tokens=5.0, drift=None,
                      times={"gen_time": 1.0, "logprob_time": 1.0, "update_time": 1.0})
    m = step_metrics(traj, stats, _OneRank(), lr=0.01, nonfinite_skipped=0, step_time=4.0)
    assert m["entropy"] == (1 + 2 + 3 + 4 + 5) / 5
    assert m["response_len"] == 5 / 4
    assert m["rollout_logprob_gap"] == (0.5 + 0 + 0.25 + 0 + 0) / 5


def test_the_updates_own_forward_fills_the_old_policy_values_and_is_weights():
    """``weigh_from_update`` (one epoch, one mini-batch: the update's first forward is the old
    policy's) for this rank's row 1 alone: its old log-probs and entropies are the forward's,
    its token advantages the strategy's, and with ``tis_cap`` its weights ``min(π_old / μ,
    cap)`` at valid tokens, ``μ`` the engine's probability. Catches the ratio taken the other
    way (``μ / π_old``: at the engine's -0.25 and the forward's -1.0, 1.5 (2.1 capped) against
    0.47), the cap not applied, and another row's values filled."""
    import pepo.weighting as pw

    traj = _trajectory()
    traj.old_logprobs = traj.entropies = traj.token_advantages = None
    traj.groups = torch.tensor([1, 1])  # the second prompt's group
    rows = torch.tensor([1])
    lp = torch.tensor([[-1.0, 5.0, 5.0]])  # the forward's; -0.25 the engine's at the token
    ent = torch.tensor([[0.5, 0.0, 0.0]])
    weigh_from_update(traj, rows, lp, ent, pw.get_strategy("uniform"), tis_cap=1.5)
    assert torch.equal(traj.old_logprobs[1], lp[0]) and torch.equal(traj.entropies[1], ent[0])
    assert float(traj.token_advantages[1, 0]) == -0.5  # this rank's row 1: A = -0.5
    assert float(traj.is_weights[1, 0]) == pytest.approx(min(math.exp(-1.0 + 0.25), 1.5))
    assert not traj.old_logprobs[0].any() and not traj.is_weights[0].any()  # row 0 untouched
    weigh_from_update(traj, torch.tensor([0]), torch.tensor([[-0.5, -2.0, -2.0]]),
                      torch.zeros(1, 3), pw.get_strategy("uniform"), tis_cap=1.5)
    # the engine's -1.0, -2.0, -0.5: ratios e^0.5 (capped at 1.5), 1, e^-1.5
    torch.testing.assert_close(traj.is_weights[0], torch.tensor(
        [1.5, 1.0, math.exp(-1.5)]), rtol=1e-6, atol=0)


class _TwoRanks:
    """Sums as if a second rank held ``other`` ([total, count]) too."""

    def __init__(self, other):
        self.other = torch.tensor(other, dtype=torch.float64)

    def sum(self, t):
        return t + self.other.to(t.dtype)


def test_mean_abs_change_against_a_loop():
    """SPO's drift: the mean |new - old| over valid tokens with a finite difference, from a loop
    over the tokens. Catches padding counted, a NaN row making the whole mean NaN (logged as 0:
    no forgetting though the other rows' steps moved the policy), the other ranks' tokens left
    out, and a division by zero where no token counts."""
    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    old[1] = float("nan")  # row 1's old-policy pass was NaN
    new[0, 4] = float("inf")  # at padding: ignored
    diffs = [abs(float(new[i, t]) - float(old[i, t])) for i in range(3) for t in range(5)
             if mask[i, t] and math.isfinite(float(new[i, t]) - float(old[i, t]))]
    assert len(diffs) == 4
    assert mean_abs_change(new, old, mask, _OneRank()) == pytest.approx(
        sum(diffs) / len(diffs), rel=1e-6)
    assert mean_abs_change(new, old, mask, _TwoRanks([6.0, 2.0])) == pytest.approx(
        (sum(diffs) + 6.0) / (len(diffs) + 2), rel=1e-6)
    assert mean_abs_change(new, old, torch.zeros_like(mask), _OneRank()) == 0.0
    # bf16 log-probs: subtracted and summed in fp32 (a bf16 sum of 4,096 terms is ~2e-3 off)
    big_new, big_old = (torch.randn(64, 64, generator=g).bfloat16() for _ in range(2))
    ref = (big_new.double() - big_old.double()).abs().mean().item()
    got = mean_abs_change(big_new, big_old, torch.ones(64, 64, dtype=torch.bool), _OneRank())
    assert got == pytest.approx(ref, rel=1e-6)
    assert mean_abs_change(new, old.fill_(float("nan")), mask, _OneRank()) == 0.0


class _Checkpoints:
    keep = 2

    def __init__(self, best):
        self._best = best

    def best(self):
        return self._best

    def metadata(self, path):
        return {"val_accuracy": 0.75, "step": 4}


def test_closing_summary():
    history = [{"step": 0, "val_accuracy": 0.5}, {"step": 4, "val_accuracy": 0.75},
               {"step": 8, "val_accuracy": 0.625}]
    assert closing_summary(history, 8, _Checkpoints("run/step_4")) == [
        "Validation accuracy (avg@8): 0.500 before -> 0.625 after (highest 0.750 at step 4)",
        "Best validation checkpoint (kept with the newest 2): run/step_4 (avg@8 0.750 at step 4)"]
    assert closing_summary(history, 8) == closing_summary(history, 8, _Checkpoints(None))[:1]
    assert closing_summary([{"step": 1, "loss": 0.0}], 8) == []
    # a resume changed validation.samples: each validation's own k (recorded in its entry)
    mixed = [{"step": 0, "val_accuracy": 0.5, "val_samples": 1},
             {"step": 4, "val_accuracy": 0.75, "val_samples": 1},
             {"step": 8, "val_accuracy": 0.625, "val_samples": 4}]
    assert closing_summary(mixed, 4, _Checkpoints("run/step_4")) == [
        "Validation accuracy: 0.500 before (avg@1) -> 0.625 after (avg@4) (highest 0.750 at "
        "step 4, avg@1)",
        "Best validation checkpoint (kept with the newest 2): run/step_4 (avg@1 0.750 at step 4)"]
    same = [dict(h, val_samples=4) for h in mixed]
    assert closing_summary(same, 1)[0] == (
        "Validation accuracy (avg@4): 0.500 before -> 0.625 after (highest 0.750 at step 4)")


@pytest.fixture(scope="module")
def model():
    from pepo.training.models import tiny_qwen3

    torch.manual_seed(0)
    m = tiny_qwen3(embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   intermediate_dim=64, head_dim=16)
    return m.eval()


def test_policy_forward_masked_equals_sliced_and_hidden_equals_logits(model):
    """A row's log-probs and entropies in a padded batch are those of the row alone, unpadded
    (catches an attention mask or positions that let padding in), and the chunked output
    projection (``from_hidden``) gives the logits path's numbers (a reference from
    ``log_softmax`` of the model's own logits at temperature 0.5)."""
    prompts = [[3, 4, 5, 6], [7, 8]]
    responses = torch.tensor([[9, 10, 11], [12, 13, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ptok, pmask = pad_prompts(prompts, pad_id=0)
    ro = Rollouts(ptok, pmask, responses, mask, torch.tensor([True, True]))
    rows = torch.arange(2)
    with torch.no_grad():
        lp, ent = policy_logprobs(model, ro, rows, chunk_size=2, temperature=0.5)
        lp_h, ent_h = policy_logprobs(model, ro, rows, chunk_size=2, temperature=0.5,
                                      from_hidden=True)
        torch.testing.assert_close(lp_h, lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_h, ent, rtol=1e-5, atol=1e-5)
        for i, prompt in enumerate(prompts):
            n = int(mask[i].sum())
            seq = torch.tensor([prompt + responses[i, :n].tolist()])
            logits = model(seq)[0, len(prompt) - 1: len(prompt) - 1 + n].double() / 0.5
            ref = torch.log_softmax(logits, -1)
            ref_lp = ref.gather(-1, responses[i, :n, None])[:, 0]
            ref_ent = -(ref.exp() * ref).sum(-1)
            torch.testing.assert_close(lp[i, :n].double(), ref_lp, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ent[i, :n].double(), ref_ent, rtol=1e-4, atol=1e-5)
    assert not math.isnan(float(lp[mask].sum()))


def test_from_hidden_takes_only_a_head_that_is_its_weights_product(model):
    """``from_hidden`` multiplies the hidden states by the head's weight alone. Catches a head
    with a bias (or of another kind, as a LoRA head) whose extra terms would be dropped in
    silence (a clear error instead, naming the key to turn off), and an untied bias-free
    ``nn.Linear`` head read from the wrong place (its logits path's numbers)."""
    import copy

    from pepo.training.models import check_model

    ro = Rollouts(*pad_prompts([[3, 4, 5], [6]], pad_id=0), torch.tensor([[7, 8], [9, 0]]),
                  torch.tensor([[True, True], [True, False]]), torch.tensor([True, True]))
    rows, kw = torch.arange(2), dict(chunk_size=2, temperature=0.7)
    untied = copy.deepcopy(model)
    untied.output = torch.nn.Linear(32, model.tok_embeddings.num_embeddings, bias=False)
    biased = copy.deepcopy(model)
    biased.output = torch.nn.Linear(32, model.tok_embeddings.num_embeddings)
    wrapped = copy.deepcopy(model)
    wrapped.output = torch.nn.Sequential(untied.output)
    message = ("logprobs_from_hidden=true needs an output head that is one matrix product .* "
               "this model's is a {}: set logprobs_from_hidden=false")
    with torch.no_grad():
        lp, ent = policy_logprobs(untied, ro, rows, **kw)
        lp_h, ent_h = policy_logprobs(untied, ro, rows, from_hidden=True, **kw)
        torch.testing.assert_close(lp_h, lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_h, ent, rtol=1e-5, atol=1e-5)
        for bad, kind in ((biased, "Linear with a bias"), (wrapped, "Sequential")):
            policy_logprobs(bad, ro, rows, **kw)  # the logits path takes any head
            with pytest.raises(ValueError, match=message.format(kind)):
                policy_logprobs(bad, ro, rows, from_hidden=True, **kw)
            with pytest.raises(ValueError, match=message.format(kind)):
                check_model(bad, 10, logprobs_from_hidden=True)
            check_model(bad, 10, logprobs_from_hidden=False)
    check_model(model, model.tok_embeddings.num_embeddings, logprobs_from_hidden=True)
    with pytest.raises(ValueError, match=f"tokenizer has {model.tok_embeddings.num_embeddings + 1} "
                       f"tokens but the model embeds only {model.tok_embeddings.num_embeddings}"):
        check_model(model, model.tok_embeddings.num_embeddings + 1, logprobs_from_hidden=False)


def test_policy_forward_keeps_the_logits_within_its_budget(model, monkeypatch):
    """``save_logits_mib``: the head keeps its logits for the backward exactly when the
    responses' fp32 logits (``[b, T', V]``, the rows' own extent) fit the budget (catches the
    budget counted over the whole sequence or the batch's full width, or never passed on); the
    model's gradients are the same either way."""
    import pepo.training.step as step

    ptok, pmask = pad_prompts([[3, 4, 5, 6], [7, 8]], pad_id=0)
    responses = torch.tensor([[9, 10, 11, 0], [12, 13, 0, 0]])
    ro = Rollouts(ptok, pmask, responses, responses != 0, torch.tensor([True, True]))
    fits = 2 * 3 * model.tok_embeddings.num_embeddings * 4 / 2**20  # 2 rows x 3 columns of V
    seen = []
    head = step.logprobs_and_entropy_from_hidden
    monkeypatch.setattr(step, "logprobs_and_entropy_from_hidden",
                        lambda *a, **k: seen.append(k["save_logits"]) or head(*a, **k))
    grads = []
    for mib in (fits, fits * 0.99, 0):
        model.zero_grad(set_to_none=True)
        lp, _ = policy_logprobs(model, ro, torch.arange(2), chunk_size=2, temperature=0.7,
                                from_hidden=True, save_logits_mib=mib)
        (lp * torch.linspace(-1, 1, 4)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert seen == [True, False, False]
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=0, atol=0)
    model.zero_grad(set_to_none=True)


def test_a_micro_batch_is_cut_to_its_own_rows_extent(model):
    """Rows of a micro-batch are run over their own extent: the prompt columns that are padding
    in all of them and the response columns after their longest response are cut, and the
    outputs padded back with zeros. Row 1 alone (its prompt 2 tokens shorter than row 0's, its
    response 2 of 4 columns) gives the numbers of the row alone, unpadded (catches positions or
    a mask that shift with the cut, a cut on the wrong side), zeros after its response, and
    the full width ``T`` (catches outputs left narrow)."""
    prompts = [[3, 4, 5, 6], [7, 8]]
    responses = torch.tensor([[9, 10, 11, 12], [13, 14, 0, 0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    ptok, pmask = pad_prompts(prompts, pad_id=0)
    ro = Rollouts(ptok, pmask, responses, mask, torch.tensor([True, True]))
    assert row_extent(pmask[1:], mask[1:]) == (2, 2)
    assert row_extent(pmask, mask) == (0, 4)
    assert row_extent(pmask[1:], torch.zeros(1, 4, dtype=torch.bool)) == (2, 1)
    for from_hidden in (False, True):
        with torch.no_grad():
            lp, ent = policy_logprobs(model, ro, torch.tensor([1]), chunk_size=3,
                                      temperature=0.7, from_hidden=from_hidden)
        assert lp.shape == ent.shape == (1, 4)
        seq = torch.tensor([[7, 8, 13, 14]])
        logits = model(seq)[0, 1:3].double() / 0.7
        ref = torch.log_softmax(logits, -1)
        torch.testing.assert_close(lp[0, :2].double(), ref.gather(-1, seq[0, 2:, None])[:, 0],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[0, :2].double(), -(ref.exp() * ref).sum(-1),
                                   rtol=1e-5, atol=1e-5)
        assert lp[0, 2:].tolist() == [0.0, 0.0] and ent[0, 2:].tolist() == [0.0, 0.0]


def test_by_length_orders_rows_by_response_length_stably():
    """Micro-batches are cut from rows ordered by response length, ties in their given order
    (catches ordering by row index or by the lengths of the wrong rows)."""
    mask = torch.zeros(6, 5, dtype=torch.bool)
    for i, n in enumerate([5, 1, 3, 1, 4, 2]):
        mask[i, :n] = True
    assert by_length(torch.tensor([4, 0, 3, 1, 5]), mask).tolist() == [3, 1, 5, 4, 0]
    assert by_length(torch.arange(6), mask).tolist() == [1, 3, 5, 2, 4, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device: CUDA")
def test_by_length_takes_cpu_rows_and_a_cuda_mask():
    """The recipe orders ``torch.arange(b)`` (CPU) by a mask on the GPU: catches the order's
    indices left on the mask's device (indexing the CPU rows with CUDA indices raised, so no
    ``device: cuda`` run got past its first step)."""
    mask = torch.zeros(6, 5, dtype=torch.bool)
    for i, n in enumerate([5, 1, 3, 1, 4, 2]):
        mask[i, :n] = True
    got = by_length(torch.arange(6), mask.cuda())
    assert got.device.type == "cpu" and got.tolist() == [1, 3, 5, 2, 4, 0]


def test_a_registered_strategys_own_nan_stops_the_run_naming_it(monkeypatch):
    """The recipe weighs with ``validate=False`` (a NaN logit's NaN token advantages are
    skipped by the loss guard); a registered strategy's own NaN (``A / |A|`` at a zero
    advantage) was skipped the same way, step after step, and the run exited 0 or stopped
    blaming the loss. Catches the check missing, made for the built-ins (a sync they do not
    need), a NaN input (entropies of a NaN logit, which a windowed fn may spread to finite
    neighbours) blamed on the strategy, and a rank stopping alone (the others went on into
    the update's collectives and hung: the counts are summed over the processes)."""
    import pepo.weighting as pw
    from pepo.training.step import weigh
    from pepo.training.stopping import NonFiniteError

    @pw.register_strategy("test_signed", overwrite=True)
    def signed():
        def fn(advantages, entropies, mask):
            return (advantages / advantages.abs())[:, None] * entropies

        return fn

    try:
        adv = torch.tensor([1.0, 0.0, -2.0])
        ent = torch.rand(3, 4) + 0.1
        mask = torch.ones(3, 4, dtype=torch.bool)
        mask[2, 3] = False
        with pytest.raises(NonFiniteError, match=r"^strategy 'test_signed' returned 4 non-finite "
                                                 r"token advantages at valid tokens from finite"):
            weigh(pw.get_strategy("test_signed"), adv, ent, mask)
        ok = weigh(pw.get_strategy("test_signed"), torch.tensor([1.0, 0.5, -2.0]), ent, mask)
        assert torch.isfinite(ok).all()
        ent[0, 1] = float("nan")  # a NaN logit's entropy: the loss guard's to skip
        assert torch.isnan(weigh(pw.get_strategy("test_signed"), adv, ent, mask)).any()
        # another rank's rows held the NaN: this rank stops with it (the counts are summed)
        import torch.distributed as dist

        def others(counts, group=None):
            assert group == "the group"
            counts += torch.tensor([0, 0, 3])

        monkeypatch.setattr(dist, "all_reduce", others)
        with pytest.raises(NonFiniteError, match=r"^strategy 'test_signed' returned 3 non-finite"):
            weigh(pw.get_strategy("test_signed"), torch.tensor([1.0, 0.5, -2.0]),
                  ent.nan_to_num(), mask, process_group="the group")

        def no_sync(self):
            raise AssertionError("a built-in strategy's result was read on the host")

        monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
        weigh(pw.get_strategy("uniform"), adv, ent, mask)  # a built-in: never checked here
    finally:
        pw._REGISTRY.pop("test_signed", None)


def test_logits_are_kept_while_they_fit_the_budget():
    """fp32 logits of ``targets x vocab`` within ``save_logits_mib`` MiB are kept, one token
    more is not, and a budget of 0 keeps none. Catches a bf16 size (2 bytes) taken for the fp32
    logits, a budget read in MB, and a strict comparison at the limit."""
    assert saves_logits(8 * 41, 49152, 512)  # SmolLM2's micro-batch: 61.5 MiB
    assert saves_logits(1024, 256, 1) and not saves_logits(1025, 256, 1)  # 1 MiB exactly
    assert not saves_logits(1, 1, 0)
