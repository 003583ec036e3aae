"""The chunked LM head (``grpo.scoring.chunked_head``): the head and the log-normaliser a chunk of positions
at a time, recomputed in backward, against the plain head's full logits."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from grpo.scoring import chunked_head, head_products, logprobs, packing
from grpo.scoring.chunked_head import History, Scorer, chunked_head_slot
from grpo.scoring.distribution import Decoding, process_logits
from grpo.scoring.logprobs import completion_logprobs, token_logprobs

SAMPLINGS = {
    "temperature 1": Decoding(),
    "temperature 0.7": Decoding(0.7),
    "penalty and truncation": Decoding(0.8, top_k=30, top_p=0.9, repetition_penalty=1.3),
}


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _batch(g: int = 6, n: int = 12):
    """Two groups of ``g`` completions of up to ``n`` tokens (lengths differ), prompts of 5 and 3
    tokens, left padded: the packed layout's kept positions outnumber CHUNK several times."""
    gen = torch.Generator().manual_seed(1)
    prompts = [[10, 11, 12, 13, 14], [20, 21, 22]]
    rows = 2 * g
    prompt_ids = torch.zeros(rows, 5, dtype=torch.long)
    prompt_mask = torch.zeros(rows, 5, dtype=torch.bool)
    completion_ids = torch.randint(3, 100, (rows, n), generator=gen)
    completion_mask = torch.zeros(rows, n, dtype=torch.bool)
    for i in range(rows):
        p = prompts[i % 2]
        prompt_ids[i, 5 - len(p) :] = torch.tensor(p)
        prompt_mask[i, 5 - len(p) :] = True
        completion_mask[i, : 2 + i % (n - 1)] = True
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _chunks_of(rows: int, vocab: int, monkeypatch) -> None:
    """Chunks of ``rows`` positions on both of the chunked head's paths: the autograd one
    (``CHUNK``) and plain sampling's in-place one (``PLAIN_CHUNK_BYTES``), whose entropy then
    takes two rows at a time."""
    monkeypatch.setattr(chunked_head, "CHUNK", rows)
    monkeypatch.setattr(chunked_head, "PLAIN_CHUNK_BYTES", rows * 4 * vocab)
    monkeypatch.setattr(chunked_head, "ENTROPY_BLOCK_BYTES", 2 * 4 * vocab)


def _scored(model, batch, decoding, plain: bool, monkeypatch):
    """logp, entropy and every parameter's gradient of sum(logp * w) over real tokens."""
    with monkeypatch.context() as patch:
        if plain:
            patch.setattr(chunked_head, "head_slot", lambda model: None)
        model.zero_grad()
        logp, entropy = completion_logprobs(model, *batch, decoding, with_entropy=True)
        mask = batch[3]
        weights = torch.linspace(-1, 2, mask.numel(), device=mask.device).view(mask.shape)
        (logp * weights * mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return logp[mask], entropy[mask], grads


@pytest.mark.device
@pytest.mark.parametrize("head", ["chunked", "kept"])
@pytest.mark.parametrize("path", ["packed", "rows", "full"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_chunked_head_equals_the_plain_head(model, device, monkeypatch, head, path: str, name: str):
    # values, entropy and the gradient of every parameter (the tied embedding takes the head's)
    # equal the plain head's full logits, with chunks of 3 positions cutting through targets
    # that share a position (a prompt's last token predicts each completion's first); under
    # plain sampling (temperatures) the in-place path, its entropy two rows at a time, and
    # with full logits asked for ("kept") every position's logits in one buffer kept for
    # backward (other samplings then score from the model's own head)
    _chunks_of(3, model.config.vocab_size, monkeypatch)
    if head == "kept":
        chunked_head.full_logits(model)
    if path == "rows":
        monkeypatch.setattr(packing.ScoringCost, "packing_pays", lambda *_: False)
    if path == "full":
        monkeypatch.setattr(logprobs, "scoring_path", lambda model: ("rows", "test"))
    assert chunked_head.head_slot(model) is not None
    model.to(device)
    batch = [t.to(device) for t in _batch()]
    got = _scored(model, batch, SAMPLINGS[name], plain=False, monkeypatch=monkeypatch)
    want = _scored(model, batch, SAMPLINGS[name], plain=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert got[2][0].abs().sum() > 0  # the embedding (tied head) got a gradient


@pytest.mark.device
@pytest.mark.parametrize("head", ["chunked", "kept"])
def test_chunked_head_under_bf16_autocast_equals_the_plain_head(model, device, monkeypatch, head):
    # the recomputed logits are the forward's (the head's products in bf16 both times), and the
    # gradients go back through the same casts as autograd's; kept logits likewise
    _chunks_of(5, model.config.vocab_size, monkeypatch)
    if head == "kept":
        chunked_head.full_logits(model)
    hidden = model.get_output_embeddings().weight.shape[1]
    # the head's weight gradient in blocks of 7 rows of the vocabulary, the last one ragged
    monkeypatch.setattr(head_products, "PRODUCT_BLOCK_BYTES", 7 * 6 * hidden)
    assert model.get_output_embeddings().weight.shape[0] % 7
    model.to(device)
    batch = [t.to(device) for t in _batch(g=3, n=6)]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = _scored(model, batch, Decoding(0.7), plain=False, monkeypatch=monkeypatch)
        want = _scored(model, batch, Decoding(0.7), plain=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=1e-2)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("decoding", [Decoding(), Decoding(top_k=5)], ids=["plain", "top-k"])
def test_backward_recomputes_the_logits_in_the_forwards_dtype(decoding, monkeypatch) -> None:
    # backward runs outside autocast (as the trainer's does), so the head must cast itself:
    # its logits are then the forward's bf16 ones, not a float32 product autocast never made
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(6, 17)
    hidden = torch.randn(11, 6, generator=gen, requires_grad=True)
    at = torch.tensor([[0, 3, 4], [0, 7, 10]])
    scorer = Scorer.of(at, torch.randint(0, 17, (2, 3), generator=gen), decoding, False, None, 11)
    seen: list[torch.dtype] = []
    linear = F.linear

    def spy(*args, **kwargs):
        out = linear(*args, **kwargs)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(F, "linear", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        picked, lse, _ = chunked_head._ChunkedHead.apply(
            hidden, head.weight, head.bias, scorer, 4, [], False, False, True
        )
    (picked.sum() + lse.sum()).backward()
    assert seen == [torch.bfloat16] * 6  # three chunks forward, three in backward


def test_a_head_weight_computed_from_others_hands_its_gradient_on() -> None:
    # in place, the head adds into its weight's .grad; a weight that is no leaf (computed from
    # a parameter, as a parametrization does) keeps none, so its gradient must go through
    # autograd to the parameter, micro-batch after micro-batch, as the plain head's does
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(17, 6, generator=gen, requires_grad=True)
    hidden = torch.randn(11, 6, generator=gen)
    at = torch.tensor([[0, 3, 4], [0, 7, 10]])
    scorer = Scorer.of(at, torch.randint(0, 17, (2, 3), generator=gen), Decoding(), False, None, 11)
    for _ in range(2):
        picked, lse, _ = chunked_head._ChunkedHead.apply(
            hidden, base * 2.0, None, scorer, 4, [], True, False, True
        )
        scorer.logprobs(picked, lse, None, None)[0].sum().backward()
    got = base.grad.clone()
    base.grad = None
    for _ in range(2):
        scorer.of_logits(hidden @ (base * 2.0).T, chunk=4)[0].sum().backward()
    torch.testing.assert_close(got, base.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_product_adds_every_row_of_the_product(dtype, monkeypatch) -> None:
    # out += a @ b: in bf16 a block of 5 rows at a time (37 = 7 x 5 + 2), each block added
    # into the float32 out; in float32 one addmm_. Rounded to bf16 once per block at most
    gen = torch.Generator().manual_seed(3)
    monkeypatch.setattr(head_products, "PRODUCT_BLOCK_BYTES", 5 * 6 * 8)
    a = torch.randn(37, 9, generator=gen).to(dtype)
    b = torch.randn(9, 8, generator=gen).to(dtype)
    out = torch.randn(37, 8, generator=gen)
    want = out.double() + a.double() @ b.double()
    tol = {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    before = out.clone()
    head_products.add_product_(out, a, b)
    torch.testing.assert_close(out.double(), want, **tol)
    if dtype == torch.bfloat16:
        # on the CPU, bf16 products of 5-row blocks, each widened exactly into float32: not a
        # float32 addmm_ (more precise, but 3x slower here; benchmarks.speed.levers)
        for lo in range(0, 37, 5):
            before[lo : lo + 5] += a[lo : lo + 5] @ b
        assert torch.equal(out, before)


@pytest.mark.parametrize(("budget", "blocks"), [(5, [5] * 7 + [2]), (1, [1] * 37)])
def test_add_products_bf16_blocks_keep_to_their_byte_budget(budget, blocks, monkeypatch):
    # each bf16 block's result and float32 accumulator (6 bytes a value) stay within
    # PRODUCT_BLOCK_BYTES: as many rows as fit, one row when only one does
    gen = torch.Generator().manual_seed(3)
    monkeypatch.setattr(head_products, "PRODUCT_BLOCK_BYTES", budget * 6 * 8)
    a = torch.randn(37, 9, generator=gen).bfloat16()
    b = torch.randn(9, 8, generator=gen).bfloat16()
    rows: list[int] = []
    matmul = torch.Tensor.__matmul__

    def spy(self, other):
        rows.append(self.shape[0])
        return matmul(self, other)

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    head_products.add_product_(torch.zeros(37, 8), a, b)
    assert rows == blocks


@pytest.mark.parametrize(
    ("decoding", "keep"),
    [(Decoding(0.5), False), (Decoding(0.5), True), (Decoding(0.5, top_k=5), False)],
    ids=["plain", "plain-kept", "top-k"],
)
@pytest.mark.parametrize("autocast", [False, True])
def test_a_head_with_a_bias_gets_every_gradient(autocast: bool, decoding, keep, monkeypatch):
    # the autograd function alone, on an untied head with a bias: hidden, weight and bias
    # gradients equal the full logits' (a head that needs no weight gradient gets none). Under
    # bf16 autocast the backward runs outside it, as the trainer's does, so the recomputed head
    # must cast its bias too to run in the forward's dtype (the kept logits are its products')
    gen = torch.Generator().manual_seed(0)
    m, h, v = 11, 6, 17
    monkeypatch.setattr(
        head_products, "PRODUCT_BLOCK_BYTES", 5 * 6 * h
    )  # blocks of 5, 5, 5, 2 rows
    head = nn.Linear(h, v)
    hidden = torch.randn(m, h, generator=gen, requires_grad=True)
    at = torch.tensor([[0, 3, 4], [0, 7, 10], [2, 2, 9]])  # positions shared by targets
    targets = torch.randint(0, v, (3, 3), generator=gen)
    scorer = Scorer.of(at, targets, decoding, False, None, m)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    tol = {"atol": 2e-2, "rtol": 2e-2} if autocast else {}
    extras: list = []
    with bf16:
        picked, lse, entropy = chunked_head._ChunkedHead.apply(
            hidden, head.weight, head.bias, scorer, 4, extras, False, keep, True
        )
    got = scorer.logprobs(picked, lse, *extras, entropy)[0]
    got.sum().backward()
    grads = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
    for t in (hidden, head.weight, head.bias):
        t.grad = None
    with bf16:
        want = scorer.of_logits(head(hidden), chunk=4)[0]
    want.sum().backward()
    torch.testing.assert_close(got, want, **tol)
    for g, t in zip(grads, (hidden, head.weight, head.bias), strict=True):
        torch.testing.assert_close(g, t.grad, **tol)
    head.requires_grad_(False)
    head.weight.grad = head.bias.grad = hidden.grad = None
    extras = []
    with bf16:
        picked, lse, entropy = chunked_head._ChunkedHead.apply(
            hidden, head.weight, head.bias, scorer, 4, extras, False, keep, True
        )
    scorer.logprobs(picked, lse, *extras, entropy)[0].sum().backward()
    assert head.weight.grad is None and head.bias.grad is None
    torch.testing.assert_close(hidden.grad, grads[0])


@pytest.mark.parametrize(
    ("decoding", "keep"),
    [(Decoding(0.7), False), (Decoding(0.7), True), (Decoding(0.7, top_k=5), False)],
    ids=["plain", "plain-kept", "top-k"],
)
@pytest.mark.parametrize("used", ["picked", "lse"])
def test_a_loss_on_one_output_alone_gets_that_outputs_gradient(decoding, keep, used) -> None:
    # the autograd function on its own, with a loss that reads only the picked logits or only
    # the log-normaliser: the output it leaves out reaches backward as None (grads are not
    # materialised) and adds nothing. A bf16 head, as a model loaded in bf16 has (the zeros
    # that stand in must meet the float32 logit gradients), more positions than hidden units
    gen = torch.Generator().manual_seed(4)
    m, h, v = 11, 6, 17
    weight = torch.randn(v, h, generator=gen).bfloat16().requires_grad_()
    hidden = torch.randn(m, h, generator=gen).bfloat16().requires_grad_()
    at = torch.tensor([[0, 3, 4], [0, 7, 10], [2, 2, 9]])
    targets = torch.randint(0, v, (3, 3), generator=gen)
    scorer = Scorer.of(at, targets, decoding, False, None, m)
    picked, lse, _ = chunked_head._ChunkedHead.apply(
        hidden, weight, None, scorer, 4, [], False, keep, True
    )
    out = picked if used == "picked" else lse
    coefficients = torch.linspace(-1.0, 2.0, out.numel())
    (out * coefficients).sum().backward()
    got = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    # the same terms of the full logits, through autograd
    picked, lse, _, _ = scorer.terms(F.linear(hidden, weight), 0, (0, targets.numel()))
    ((picked if used == "picked" else lse) * coefficients).sum().backward()
    for g, want in zip(got, (hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(g, want, atol=2e-2, rtol=2e-2)
        assert want.abs().max() > 0.1


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_plain_sampling_in_place_divides_by_any_temperature(temperature, keep) -> None:
    # the in-place path divides the logits by the temperature (in forward, again in backward,
    # and the logits' gradient by it) unless it is 1: at 1 and at 2, log-probs, entropies and
    # the gradients of a loss on both equal the full logits' through autograd
    gen = torch.Generator().manual_seed(6)
    m, h, v = 11, 6, 17
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    hidden = torch.randn(m, h, generator=gen, requires_grad=True)
    at = torch.tensor([[0, 3, 4], [0, 7, 10], [2, 2, 9]])
    targets = torch.randint(0, v, (3, 3), generator=gen)
    scorer = Scorer.of(at, targets, Decoding(temperature), True, None, m)
    extras: list = []
    picked, lse, entropy = chunked_head._ChunkedHead.apply(
        hidden, weight, None, scorer, 4, extras, False, keep, True
    )
    got = scorer.logprobs(picked, lse, *extras, entropy)
    (got[0].sum() + 3.0 * got[1].sum()).backward()
    grads = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    want = scorer.of_logits(hidden @ weight.T, chunk=4)
    (want[0].sum() + 3.0 * want[1].sum()).backward()
    scaled = torch.log_softmax((hidden @ weight.T).detach() / temperature, dim=-1)
    torch.testing.assert_close(want[0], scaled[at, targets])  # the reference divides
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for g, w in zip(grads, (hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("keep", [False, True])
def test_the_bias_gradient_is_summed_in_float32_under_autocast(keep) -> None:
    # under bf16 autocast the logits' gradient is bf16, but the float32 bias adds it up over
    # the positions in float32: with every logit equal (a zero weight), each position's
    # gradient (3/4 at its target, -1/4 elsewhere, times its weight of 1 or 2^-8) is exact in
    # bf16, and their sums (1 + 2^-8 times those) are exact in float32 but not in bf16
    v = 4
    head = nn.Linear(6, v)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    hidden = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    at, targets = torch.tensor([[0, 1]]), torch.zeros(1, 2, dtype=torch.long)
    scorer = Scorer.of(at, targets, Decoding(), False, None, 2)
    extras: list = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        picked, lse, entropy = chunked_head._ChunkedHead.apply(
            hidden, head.weight, head.bias, scorer, 4, extras, False, keep, True
        )
    logp = scorer.logprobs(picked, lse, *extras, entropy)[0]
    (logp * torch.tensor([[1.0, 2.0**-8]])).sum().backward()
    want = torch.tensor([0.75, -0.25, -0.25, -0.25]) * (1 + 2.0**-8)
    assert torch.equal(head.bias.grad, want)
    assert not torch.equal(want.bfloat16().float(), want)  # bf16 would round the sums


def test_a_models_head_with_a_bias_equals_the_plain_head(tiny_model_dir, monkeypatch) -> None:
    # the scoring head that stands in for the model's own passes its bias on: values and every
    # gradient, the bias's included, are the plain head's
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    _chunks_of(4, model.config.vocab_size, monkeypatch)
    torch.manual_seed(0)
    model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features)
    nn.init.normal_(model.lm_head.bias)  # large enough to move every log-prob
    batch = _batch(g=3, n=6)
    got = _scored(model, batch, Decoding(0.7), plain=False, monkeypatch=monkeypatch)
    want = _scored(model, batch, Decoding(0.7), plain=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert got[2][-1].abs().sum() > 0  # the bias got a gradient


@pytest.mark.parametrize(("positions", "chunk"), [(1, 1), (5, 1), (8, 4), (9, 4), (3, 8)])
def test_chunks_of_any_size_score_every_position(positions: int, chunk: int) -> None:
    # chunks of one position, chunks that divide the positions or not, one chunk past them all:
    # every target's log-prob and entropy are the plain log-softmax's
    gen = torch.Generator().manual_seed(positions)
    logits = torch.randn(positions, 7, generator=gen)
    at = torch.randint(0, positions, (2, 3), generator=gen)
    targets = torch.randint(0, 7, (2, 3), generator=gen)
    logp, entropy = token_logprobs(logits, at, targets, with_entropy=True, chunk=chunk)
    plain = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logp, plain[at, targets])
    torch.testing.assert_close(entropy, -(plain.exp() * plain).sum(dim=-1)[at])


@pytest.mark.parametrize(
    ("keep", "positions"), [(0, 10), (3, 6), (5, 10), (7, 10), (torch.tensor([1, 4]), 4)]
)
def test_kept_positions_are_those_a_forward_computes(keep, positions: int) -> None:
    # as transformers keeps them: 0 (its default) every position, a count the last ones up to
    # the whole sequence (5 and more: all 5), a tensor those positions of every sequence
    assert chunked_head.kept_positions(torch.zeros(2, 5, dtype=torch.long), keep) == positions


class _Policy(nn.Module):
    pass


class _Wrapped(nn.Module):
    """As DDP holds a model: on ``.module``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = _Policy()


def test_a_forward_that_computed_other_positions_is_refused_by_the_models_name() -> None:
    # a forward given no logits_to_keep computes every position, one given 3 the last 3 of
    # each row; any other count is refused, with the whole message, naming the model (under a
    # wrapper, the wrapped one)
    ids = torch.zeros(2, 5, dtype=torch.long)
    chunked_head._check_positions(_Policy(), 10, {"input_ids": ids})
    chunked_head._check_positions(_Wrapped(), 6, {"input_ids": ids, "logits_to_keep": 3})
    tail = ": its forward does not honour logits_to_keep, so it cannot be scored packed$"
    for model, inputs, got, want in [
        (_Policy(), {"input_ids": ids}, 4, 10),
        (_Wrapped(), {"input_ids": ids, "logits_to_keep": 3}, 10, 6),
    ]:
        message = f"^_Policy computed {got} positions' logits where logits_to_keep asked for {want}"
        with pytest.raises(RuntimeError, match=message + tail):
            chunked_head._check_positions(model, got, inputs)


def test_a_penalty_without_the_history_it_reads_is_refused() -> None:
    # the whole message, since it is all a caller is told of what to pass
    at, targets = torch.tensor([[0, 1]]), torch.tensor([[3, 4]])
    penalty = Decoding(repetition_penalty=1.3)
    with pytest.raises(ValueError, match=r"^repetition_penalty needs each row's history to score$"):
        Scorer.of(at, targets, penalty, False, None, 2)
    ones = torch.ones(1, 2, dtype=torch.bool)
    scorer = Scorer.of(at, targets, penalty, False, History(at, ones, targets, ones), 2)
    # a scorer made by hand without the owners of its positions: refused, not a TypeError
    with pytest.raises(ValueError, match="repetition_penalty needs the tokens seen"):
        dataclasses.replace(scorer, owners=None).terms(torch.zeros(2, 8), 0, (0, 2))


def test_micro_batches_accumulate_the_heads_gradient_into_the_weights(model, monkeypatch):
    # every micro-batch adds the head's gradient into the (tied) weight's .grad in place, the
    # first making it: after both, every gradient equals the full logits' accumulated over both
    _chunks_of(4, model.config.vocab_size, monkeypatch)
    first, second = _batch(g=3, n=6), _batch(g=2, n=9)

    def accumulated(plain: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            if plain:
                patch.setattr(chunked_head, "head_slot", lambda model: None)
            model.zero_grad(set_to_none=True)
            for batch in (first, second):
                logp, _ = completion_logprobs(model, *batch, Decoding(0.9))
                (logp * batch[3]).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    added = []
    original = torch.Tensor.addmm_

    def spy(self, *args, **kwargs):
        added.append(self is model.lm_head.weight.grad)
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "addmm_", spy)
        got = accumulated(plain=False)
    assert added and all(added)  # every chunk of both micro-batches wrote into .grad
    for g, w in zip(got, accumulated(plain=True), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_the_embedding_lookup_adds_its_rows_into_the_dense_grad(tiny_model_dir, monkeypatch, tied):
    # lookup_into_grad: the lookup's gradient is sparse where it meets a dense one (the tied
    # head's in the same backward, or .grad from an earlier micro-batch), so no dense [V, H]
    # lookup gradient is made; .grad stays dense and equals the dense lookup's, micro-batch
    # after micro-batch
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=tied)
    emb = model.get_input_embeddings()
    assert (model.lm_head.weight is emb.weight) == tied
    first, second = _batch(g=3, n=6), _batch(g=2, n=9)
    layouts: list[torch.layout] = []
    emb.weight.register_hook(lambda grad: layouts.append(grad.layout))
    lookups: list[bool] = []  # sparse or not, as each forward looks up
    emb.register_forward_pre_hook(lambda module, args: lookups.append(module.sparse))

    def accumulated(dense: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            if dense:
                patch.setattr(
                    chunked_head, "lookup_into_grad", lambda model: contextlib.nullcontext()
                )
            model.zero_grad(set_to_none=True)
            for batch in (first, second):
                logp, _ = completion_logprobs(model, *batch, Decoding(0.9))
                (logp * batch[3]).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    got = accumulated(dense=False)
    # tied: the rows alone, both times (the head's gradient went into .grad in place, made by
    # the head at the first micro-batch). Untied: a dense lookup gradient becomes .grad; then
    # the rows
    assert layouts == [torch.sparse_coo if tied else torch.strided, torch.sparse_coo]
    # tied, the first micro-batch's rows meet the head's dense gradient: sparse from the start
    assert lookups == [tied, True]
    assert emb.weight.grad.layout == torch.strided and not emb.sparse
    layouts.clear()
    lookups.clear()
    want = accumulated(dense=True)
    assert layouts == [torch.strided, torch.strided] and lookups == [False, False]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert want[0].abs().sum() > 0
    with torch.no_grad():  # frozen forwards are untouched
        completion_logprobs(model, *first)
    assert not emb.sparse


def test_no_tensor_of_every_positions_logits_is_kept_for_backward(model, monkeypatch) -> None:
    # what the plain head keeps for backward includes the [M, V] logits (the log-normaliser's
    # input); the chunked head keeps the hidden states [M, H] and no logits larger than a chunk
    batch = _batch()
    vocab = model.config.vocab_size

    def largest_logits_kept(plain: bool) -> int:
        sizes = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 1 and t.shape[-1] == vocab:
                sizes.append(t.untyped_storage().nbytes() // t.element_size() // vocab)
            return t

        with monkeypatch.context() as patch:
            if plain:
                patch.setattr(chunked_head, "head_slot", lambda model: None)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                completion_logprobs(model, *batch)
        return max(sizes)

    positions = packing.pack(*batch).at[batch[3]].unique().numel()  # that predict a target
    assert largest_logits_kept(plain=True) >= positions
    assert largest_logits_kept(plain=False) == 0


def _softcapped_model():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=104,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,  # small: soft-capping changes every log-prob a lot
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config)


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_model_that_post_processes_its_head_keeps_the_plain_head(capsys, wrapped: bool) -> None:
    # Gemma 2 soft-caps its logits after the head: the first call sees that its output is not
    # the head's, says so in one line that names the model (never a DDP-like wrapper, which
    # says nothing of what soft-caps), and scores from the full logits from then on
    model = _softcapped_model()
    net = _Wrapper(model) if wrapped else model
    batch = _batch(g=2, n=4)
    assert chunked_head_slot(net) is not None
    logp, _ = completion_logprobs(net, *batch)
    assert capsys.readouterr().err == (
        "scoring log-probs: Gemma2ForCausalLM post-processes its LM head's output "
        "(soft-capping or scaling), so the head computes full logits\n"
    )
    assert chunked_head_slot(net) is None
    again, _ = completion_logprobs(net, *batch)
    assert "post-processes" not in capsys.readouterr().err
    ids = torch.cat([batch[0][0], batch[2][0, :2]])[None]  # row 0: its prompt of 5, 2 tokens
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    want = torch.log_softmax(logits.float(), dim=-1)[[4, 5], batch[2][0, :2]]
    torch.testing.assert_close(logp[0, :2], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, logp)


def test_a_head_that_is_no_plain_linear_keeps_the_plain_head(model, tiny_model_dir) -> None:
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert chunked_head_slot(lora) is None
    plain = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=2, target_modules=["q_proj"]),
    )
    assert chunked_head_slot(plain) is not None  # found through the PEFT wrapper


class _Wrapper(nn.Module):
    """As DDP holds a model: on ``.module``, called through its own forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, **inputs: object) -> object:
        return self.module(**inputs)


def test_full_logits_turns_the_chunked_head_off_and_on_again_through_a_wrapper(model) -> None:
    # DDP keeps the model on .module: full_logits reaches the head through it, as the slot does
    wrapped = _Wrapper(model)
    assert chunked_head_slot(wrapped) is not None
    chunked_head.full_logits(wrapped)
    assert chunked_head_slot(wrapped) is None
    assert chunked_head_slot(model) is None
    chunked_head.full_logits(wrapped, on=False)
    assert chunked_head_slot(wrapped) is not None
    chunked_head.full_logits(wrapped, on=False)  # turning it off twice is no error
    assert chunked_head_slot(model) is not None


def test_a_wrapped_model_hands_every_head_gradient_to_autograd(model, monkeypatch) -> None:
    # DDP reduces what autograd hands the weights, so under a wrapper the head's gradient is
    # never added into .grad in place: over two micro-batches (the second finds a .grad), what
    # autograd handed the tied weight sums to its .grad
    monkeypatch.setattr(chunked_head, "CHUNK", 4)
    wrapped = _Wrapper(model)
    assert chunked_head_slot(wrapped) is not None
    handed: list[torch.Tensor] = []
    model.lm_head.weight.register_hook(lambda grad: handed.append(grad.clone()))
    for batch in (_batch(g=3, n=6), _batch(g=2, n=9)):
        logp, _ = completion_logprobs(wrapped, *batch, Decoding(0.9))
        (logp * batch[3]).sum().backward()
    assert len(handed) == 2
    torch.testing.assert_close(sum(handed), model.lm_head.weight.grad)


def test_a_head_the_model_holds_in_no_module_keeps_the_plain_head() -> None:
    # the chunked head replaces the model's head where a module holds it; with none to hold the
    # replacement, the model keeps its own
    class Unheld(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = [nn.Linear(4, 8)]  # a plain list registers no submodule

        def get_output_embeddings(self) -> nn.Linear:
            return self.heads[0]

    assert chunked_head_slot(Unheld()) is None


@pytest.mark.parametrize(
    ("positions", "chunk"), [(1, 1), (170, 170), (171, 86), (270, 135), (1000, 167)]
)
def test_plain_sampling_spreads_positions_evenly_over_chunks_of_the_buffer(positions, chunk):
    # SmolLM2's vocabulary: 32 MiB of float32 logits hold 170 positions; more are spread over
    # as few chunks as hold them, evenly, not a full chunk and a ragged one that reads the
    # whole weight for a few rows. Other samplings keep CHUNK
    at = torch.zeros(1, 1, dtype=torch.long)
    plain = Scorer.of(at, at, Decoding(0.7), False, None, positions)
    assert plain.head_chunk(positions, 49152) == chunk
    top_k = Scorer.of(at, at, Decoding(0.7, top_k=5), False, None, positions)
    assert top_k.head_chunk(positions, 49152) == chunked_head.CHUNK


@pytest.mark.parametrize(("rows", "chunk"), [(1, 1), (2, 2), (3, 3)])
def test_plain_sampling_chunks_keep_to_the_buffers_budget(rows: int, chunk: int, monkeypatch):
    # a budget of ``rows`` rows of float32 logits takes at most that many positions a chunk,
    # one when only one row fits (5 positions: chunks of 1; of 2, 2, 1; of 3, 2)
    monkeypatch.setattr(chunked_head, "PLAIN_CHUNK_BYTES", rows * 4 * 40)
    at = torch.zeros(1, 1, dtype=torch.long)
    assert Scorer.of(at, at, Decoding(0.7), False, None, 5).head_chunk(5, 40) == chunk


def test_the_scoring_head_chunks_its_forwards_positions(monkeypatch) -> None:
    # the stand-in head spreads the forward's positions (23, from a [1, 23, 6] hidden) over
    # chunks of the buffer's 8 rows: 8, 8, 7, whatever the hidden size
    monkeypatch.setattr(chunked_head, "PLAIN_CHUNK_BYTES", 8 * 4 * 40)
    gen = torch.Generator().manual_seed(0)
    at = torch.randint(0, 23, (3, 3), generator=gen)
    scorer = Scorer.of(
        at, torch.randint(0, 40, (3, 3), generator=gen), Decoding(0.7), False, None, 23
    )
    chunks: list[int] = []
    terms = Scorer.plain_terms_

    def spy(self, logits, start, span, keep=False):
        chunks.append(logits.shape[0])
        return terms(self, logits, start, span, keep=keep)

    monkeypatch.setattr(Scorer, "plain_terms_", spy)
    head = chunked_head._ScoringHead(nn.Linear(6, 40), scorer, in_place=False, keep=False)
    head(torch.randn(1, 23, 6, generator=gen))
    assert chunks == [8, 8, 7]


class _Made(TorchDispatchMode):
    """Records, while on, the rows of each new tensor (no view) of ``width`` columns an op makes
    (``made``) and each product's left operand rows (``products``: op name, rows)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.made: list[int] = []
        self.products: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        seen = {a.untyped_storage().data_ptr() for a in inputs}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm", "addmm_"):  # the left operand's rows
            self.products.append((name, args[0 if name == "mm" else 1].shape[0]))
        for t in out if isinstance(out, tuple | list) else [out]:
            new = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen
            if new and t.dim() == 2 and t.shape[1] == self.width:
                self.made.append(t.shape[0])
        return out


def _logits_made(
    keep: bool, m: int, v: int, monkeypatch, entropy: bool = True, entropy_rows: int = 3
) -> tuple[list, list, list, Scorer]:
    """The plain head's forward and backward on random numbers (``m`` positions, vocabulary
    ``v``, buffer chunks of 8 and entropy blocks of ``entropy_rows`` rows): the rows of each
    new tensor of V columns an op made (no view) in forward and in backward, the products it
    ran (op name, rows) and the scorer; asserts the log-probs are the full logits'."""
    gen = torch.Generator().manual_seed(0)
    h = 6
    monkeypatch.setattr(chunked_head, "PLAIN_CHUNK_BYTES", 8 * 4 * v)
    monkeypatch.setattr(chunked_head, "ENTROPY_BLOCK_BYTES", entropy_rows * 4 * v)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    hidden = torch.randn(m, h, generator=gen, requires_grad=True)
    at = torch.randint(0, m, (4, 5), generator=gen)
    targets = torch.randint(0, v, (4, 5), generator=gen)
    scorer = Scorer.of(at, targets, Decoding(0.7), entropy, None, m)
    chunk = scorer.head_chunk(m, v)
    extras: list = []
    with _Made(v) as forward:
        picked, lse, entropy = chunked_head._ChunkedHead.apply(
            hidden, weight, None, scorer, chunk, extras, False, keep, True
        )
    with _Made(v) as backward:
        scorer.logprobs(picked, lse, *extras, entropy)[0].sum().backward()
    want = scorer.of_logits(hidden.detach() @ weight.detach().T, chunk=chunk)
    got = scorer.logprobs(picked.detach(), lse.detach(), *extras, entropy)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    return forward.made, backward.made, forward.products + backward.products, scorer


def test_the_plain_head_computes_in_one_logits_buffer_per_pass(monkeypatch) -> None:
    # under plain sampling, forward and backward each make one float32 [chunk, V] buffer and
    # work in it in place: no other tensor of a chunk's logits (softmax, its gradient, a
    # logsumexp's exp) is made, and the entropy's exp takes a few rows at a time
    forward, backward, products, scorer = _logits_made(False, 23, 40, monkeypatch)
    # chunks of 8, 8, 7 positions; the entropy's exp 3, 3, 2 (or 1) rows at a time
    assert scorer.head_chunk(23, 40) == 8 and forward == [8, 3, 3, 2, 3, 3, 2, 3, 3, 1]
    assert backward == [8]  # the buffer; the weight's gradient has H columns
    # each chunk's logits in forward; in backward again, then its hidden gradient (grad @ W)
    # and its weight gradient (grad.T @ h, into the weight's, V rows)
    backward_products = [p for c in (8, 8, 7) for p in [("mm", c), ("mm", c), ("addmm_", 40)]]
    assert products == [("mm", 8), ("mm", 8), ("mm", 7), *backward_products]


def test_an_entropy_block_of_one_row_takes_one_row_at_a_time(monkeypatch) -> None:
    # a budget that holds one row of the entropy's exp (ENTROPY_BLOCK_BYTES, 4 MiB, is one row
    # of a vocabulary of a million) takes one at a time, not more than the budget
    forward, _, _, _ = _logits_made(False, 23, 40, monkeypatch, entropy_rows=1)
    assert forward == [8] + [1] * 23


@pytest.mark.parametrize("keep", [False, True])
def test_without_entropy_a_pass_makes_the_buffer_alone(monkeypatch, keep) -> None:
    # no entropy asked for: the chunked forward exponentiates in the buffer, no row blocks;
    # kept logits still need e = exp(x - max) beside x - max, a few rows at a time
    forward, backward, _, _ = _logits_made(keep, 23, 40, monkeypatch, entropy=False)
    assert forward == ([23, 3, 3, 2, 3, 3, 2, 3, 3, 1] if keep else [8])
    assert backward == ([] if keep else [8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("count", "rows"), [(23, 1), (23, 2), (23, 3), (23, 23), (0, 2)])
def test_a_buffer_narrows_in_its_own_memory(count, rows, dtype, monkeypatch) -> None:
    # every value as .to() gives it, in the buffer's own bytes, for blocks of any rows (1: the
    # first block's output overlaps its own input; 23: one block), an odd row width, no rows
    v = 41
    monkeypatch.setattr(head_products, "PRODUCT_BLOCK_BYTES", rows * 4 * v)
    buffer = torch.randn(count, v, generator=torch.Generator().manual_seed(0)) * 100
    want = buffer.to(dtype)
    with _Made(v) as made:
        got = head_products.narrowed(buffer, dtype)
    assert got.dtype == dtype and got.shape == (count, v)
    assert count == 0 or got.data_ptr() == buffer.data_ptr()
    assert torch.equal(got, want)
    # the only new tensors are the blocks' casts, each within the budget's rows
    assert made.made == [rows] * (count // rows) + ([count % rows] if count % rows else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_buffer_in_another_dtype_is_a_copy_or_itself(dtype) -> None:
    # only a dtype of half the size fits the buffer's memory: its own dtype is the buffer
    # itself, a wider one a copy (a float64 model's head), never an error
    buffer = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    got = head_products.narrowed(buffer, dtype)
    assert got.dtype == dtype and torch.equal(got, buffer.to(dtype))
    assert (got.data_ptr() == buffer.data_ptr()) == (dtype == torch.float32)


def test_kept_bf16_logits_have_no_second_tensor_of_every_position(monkeypatch) -> None:
    # under bf16 autocast the kept head's products run a block of rows at a time into the
    # float32 buffer, and backward narrows the buffer to bf16 in its own memory: beside the
    # buffer no tensor of every position's logits is made, and the blocks change no value
    m, v, h = 23, 40, 6
    gen = torch.Generator().manual_seed(0)
    weight0 = torch.randn(v, h, generator=gen)
    hidden0 = torch.randn(m, h, generator=gen)
    at = torch.randint(0, m, (4, 5), generator=gen)
    targets = torch.randint(0, v, (4, 5), generator=gen)

    # the log-normaliser's exp 3 rows at a time (``ENTROPY_BLOCK_BYTES``)
    monkeypatch.setattr(chunked_head, "ENTROPY_BLOCK_BYTES", 3 * 4 * v)

    def run(block_rows: int) -> tuple[list[int], list[torch.Tensor]]:
        monkeypatch.setattr(head_products, "HEAD_BLOCK_ROWS", block_rows)
        monkeypatch.setattr(head_products, "PRODUCT_BLOCK_BYTES", 5 * 2 * v)  # narrowing: 2 rows
        weight = weight0.clone().requires_grad_()
        hidden = hidden0.clone().requires_grad_()
        scorer = Scorer.of(at, targets, Decoding(0.7), False, None, m)
        with _Made(v) as forward, torch.autocast("cpu", dtype=torch.bfloat16):
            picked, lse, _ = chunked_head._ChunkedHead.apply(
                hidden, weight, None, scorer, m, [], False, True, True
            )
            logp = scorer.logprobs(picked, lse, None, None)[0]
        with _Made(v) as backward:
            logp.sum().backward()
        return forward.made + backward.made, [logp.detach(), hidden.grad, weight.grad]

    made, got = run(block_rows=5)
    # the float32 buffer of every position, then blocks: the products' 5 bf16 rows, the exp's
    # 3 float32 rows, and in backward 2 rows cast to bf16 at a time (5 bf16 rows' bytes)
    assert made[0] == m and max(made[1:]) == 5
    assert made[-10:] == [2] * 9 + [1]
    _, want = run(block_rows=m)  # one block: the whole product, as before blocks
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_kept_bf16_head_products_take_the_block_rows_at_a_time(monkeypatch) -> None:
    # kept logits multiply HEAD_BLOCK_ROWS positions at a time, the last block ragged; the
    # logits are the one product's
    rows: list[int] = []
    linear = F.linear

    def spy(x, *args):
        rows.append(x.shape[0])
        return linear(x, *args)

    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(11, 6, generator=gen), torch.randn(9, 6, generator=gen).bfloat16()
    monkeypatch.setattr(head_products, "HEAD_BLOCK_ROWS", 4)
    monkeypatch.setattr(F, "linear", spy)
    got = head_products.kept_logits(h, w, None)
    assert rows == [4, 4, 3]
    assert got.dtype == torch.float32 and torch.equal(got, linear(h.bfloat16(), w).float())
    # a chunk's logits (the chunked head's buffer holds one chunk) in one product
    rows.clear()
    head_products.logits_into(torch.empty(11, 9), h, w, None)
    assert rows == [11]


def test_logits_go_into_the_buffer_with_and_without_a_bias() -> None:
    # float32 products write the chunk's logits into the buffer itself, a bias too
    gen = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(5, 6, generator=gen), torch.randn(9, 6, generator=gen), torch.randn(9)
    buffer = torch.empty(8, 9)
    for bias in (None, b):
        got = head_products.logits_into(buffer, h, w, bias)
        assert got.data_ptr() == buffer.data_ptr() and got.shape == (5, 9)
        torch.testing.assert_close(got, F.linear(h, w, bias))


@pytest.mark.parametrize(
    ("states", "head"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_logits_of_states_in_another_dtype_are_the_heads_products(states, head) -> None:
    # the product runs in the head's dtype whatever the hidden states' (bf16 states under a
    # float32 head, float32 states under a bf16 head, no autocast): their logits are those of
    # the states cast to the head's dtype
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 6, generator=gen).to(states)
    w = torch.randn(9, 6, generator=gen).to(head)
    got = head_products.logits_into(torch.empty(8, 9), h, w, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(h.to(head), w).float())


@pytest.mark.parametrize(
    "decoding", [Decoding(0.7), Decoding(0.7, top_k=5)], ids=["plain", "top-k"]
)
def test_full_logits_are_kept_under_plain_sampling_else_the_models_own(
    model, decoding, monkeypatch
):
    # asked for full logits, a plain-sampling forward runs the scoring head with its logits
    # kept (one chunk of every position); a sampling that shapes the logits runs the model's
    # own head; not asked for, the scoring head chunks and recomputes. Chunks are the scorer's
    # for the forward's positions and the head's vocabulary
    _chunks_of(3, model.config.vocab_size, monkeypatch)  # chunks of 3 of this vocabulary
    runs: list[bool] = []
    apply = chunked_head._ChunkedHead.apply
    batch = _batch(g=2, n=4)

    def spy(hidden, weight, bias, scorer, chunk, *rest):
        runs.append(rest[-2])  # keep
        # every position of the forward, spread over chunks of the scorer's size for this head
        assert chunk == scorer.head_chunk(hidden.shape[0], weight.shape[0])
        return apply(hidden, weight, bias, scorer, chunk, *rest)

    with monkeypatch.context() as patch:
        patch.setattr(chunked_head._ChunkedHead, "apply", spy)
        completion_logprobs(model, *batch, decoding)
        chunked_head.full_logits(model)
        completion_logprobs(model, *batch, decoding)
    assert runs == ([False, True] if decoding.plain else [False])


def test_kept_full_logits_are_one_buffer_and_one_product_per_pass(monkeypatch) -> None:
    # with full logits kept for backward: one product makes every position's logits in one
    # [M, V] buffer, which holds the log-softmax for backward and becomes the logits' gradient
    # there (no logits computed again, no second [M, V] tensor); the in-place passes still go
    # a chunk at a time and the entropy's exp a few rows at a time
    forward, backward, products, _ = _logits_made(True, 23, 40, monkeypatch)
    assert forward == [23, 3, 3, 2, 3, 3, 2, 3, 3, 1]
    assert backward == []
    # forward's logits; backward's hidden gradient (grad @ W) and weight gradient (grad.T @ h)
    assert products == [("mm", 23), ("mm", 23), ("addmm_", 40)]


def test_kept_logits_without_a_graph_are_left_as_logits(monkeypatch) -> None:
    # a forward under no_grad (old log-probs) takes the kept path's one product, but leaves no
    # log-softmax for a backward that never comes: no extra pass over the logits
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 6, generator=gen, requires_grad=True)
    hidden = torch.randn(9, 6, generator=gen)
    at = torch.randint(0, 9, (3, 3), generator=gen)
    scorer = Scorer.of(
        at, torch.randint(0, 40, (3, 3), generator=gen), Decoding(0.7), False, None, 9
    )
    kept: list[bool] = []
    terms = Scorer.plain_terms_

    def spy(self, logits, start, span, keep=False):
        kept.append(keep)
        return terms(self, logits, start, span, keep=keep)

    monkeypatch.setattr(Scorer, "plain_terms_", spy)
    head = chunked_head._ScoringHead(
        nn.Linear(6, 40, bias=False), scorer, in_place=False, keep=True
    )
    head.head.weight = nn.Parameter(weight)
    with torch.no_grad():
        frozen = head(hidden)
    assert kept and not any(kept)
    kept.clear()
    live = head(hidden)
    assert kept and all(kept)
    torch.testing.assert_close(frozen, live.detach())


@pytest.mark.parametrize(
    ("decoding", "keep"),
    [(Decoding(0.7), False), (Decoding(0.7), True), (Decoding(0.7, top_k=5), False)],
    ids=["plain", "plain-kept", "top-k"],
)
def test_a_micro_batch_with_no_position_to_score_gets_empty_terms(decoding, keep) -> None:
    # every completion of one token predicts nothing: no positions reach the head, and every
    # path hands back empty terms and a zero gradient, not an error from an empty buffer
    hidden = torch.zeros(0, 6, requires_grad=True)
    weight = torch.randn(17, 6, requires_grad=True)
    none = torch.zeros(0, 0, dtype=torch.long)
    scorer = Scorer.of(none, none, decoding, True, None, 0)
    extras: list = []
    chunk = scorer.head_chunk(0, 17)
    picked, lse, entropy = chunked_head._ChunkedHead.apply(
        hidden, weight, None, scorer, chunk, extras, False, keep, True
    )
    (picked.sum() + lse.sum()).backward()
    assert picked.shape == lse.shape == entropy.shape == (0,)
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_kept_logits_refuse_a_sampling_that_shapes_them() -> None:
    # the kept path takes a temperature's terms only: under top-k it would score the wrong
    # distribution, so it refuses rather than return those numbers
    at = torch.zeros(1, 1, dtype=torch.long)
    scorer = Scorer.of(at, at, Decoding(0.7, top_k=5), False, None, 1)
    hidden, weight = torch.randn(1, 6), torch.randn(17, 6)
    with pytest.raises(ValueError, match=r"^kept logits take plain sampling \(temperature only\)$"):
        chunked_head._ChunkedHead.apply(hidden, weight, None, scorer, 1, [], False, True, True)


# --------------------------------------------------------------------------------------- entropy


@pytest.mark.parametrize(
    "decoding", [Decoding(), Decoding(0.7), Decoding(0.8, top_k=4, top_p=0.9)], ids=str
)
def test_the_entropys_gradient_is_the_formulas(decoding: Decoding) -> None:
    # the entropy of the distribution sampled from, differentiated: against autograd through
    # -sum p log p over the kept tokens (removed tokens have p = 0 and get no gradient)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 11, generator=gen, requires_grad=True)
    at = torch.randint(0, 9, (3, 4), generator=gen)
    targets = torch.randint(0, 11, (3, 4), generator=gen)
    weights = torch.linspace(-1.0, 2.0, 12).view(3, 4)
    _, entropy = token_logprobs(logits, at, targets, decoding, with_entropy=True, chunk=4)
    (grad,) = torch.autograd.grad((entropy * weights).sum(), logits)
    kept = process_logits(logits, decoding)  # removed tokens at -inf
    log_p = torch.log_softmax(kept, dim=-1)
    removed = torch.isinf(kept)
    want_entropy = -(log_p.exp() * log_p.masked_fill(removed, 0.0)).sum(dim=-1)[at]
    (want,) = torch.autograd.grad((want_entropy * weights).sum(), logits)
    torch.testing.assert_close(entropy, want_entropy)
    torch.testing.assert_close(grad, want)
    assert grad.abs().max() > 1e-3 and bool(removed.any()) == decoding.truncates
    if decoding.truncates:  # a removed token's logit gets no gradient from the entropy
        assert torch.equal(grad[removed], torch.zeros(int(removed.sum())))


@pytest.mark.parametrize("decoding", [Decoding(), Decoding(0.7)], ids=str)
def test_a_token_of_probability_zero_gets_no_entropy_gradient(decoding: Decoding) -> None:
    # a logit at -inf (a token the model bans) and one 300 below the rest, whose probability
    # underflows to 0 in float32 (exp(-300)): dH/dx = -p (log p + H) is 0 at both, and the
    # rows' other tokens take the formula's gradient (against autograd through -sum p log p)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, generator=gen)
    logits[:, 0] = -float("inf")
    logits[:, 1] = -300.0
    logits.requires_grad_()
    at, targets = torch.arange(4).view(2, 2), torch.full((2, 2), 5)
    weights = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    _, entropy = token_logprobs(logits, at, targets, decoding, with_entropy=True, chunk=2)
    (grad,) = torch.autograd.grad((entropy * weights).sum(), logits)
    log_p = torch.log_softmax(process_logits(logits, decoding), dim=-1)
    never = log_p.exp() == 0  # the two low tokens of every row
    want_entropy = -(log_p.exp() * log_p.masked_fill(never, 0.0)).sum(dim=-1)[at]
    (want,) = torch.autograd.grad((want_entropy * weights).sum(), logits)
    assert bool(never[:, :2].all()) and not bool(never[:, 2:].any())
    torch.testing.assert_close(entropy, want_entropy)
    torch.testing.assert_close(grad, want)
    assert torch.equal(grad[:, :2], torch.zeros(4, 2)) and grad[:, 2:].abs().min() > 0


@pytest.mark.parametrize("head", ["chunked", "kept"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_the_chunked_heads_entropy_gradient_equals_the_plain_heads(
    model, monkeypatch, head: str, name: str
) -> None:
    # a loss on log-probs and entropies (an entropy bonus): every parameter's gradient equals
    # the plain head's, on the in-place path (plain sampling: recomputed, or kept) and through
    # autograd (penalty and truncation)
    _chunks_of(3, model.config.vocab_size, monkeypatch)
    if head == "kept":
        chunked_head.full_logits(model)
    batch, mask = _batch(g=3, n=6), _batch(g=3, n=6)[3]
    weights = torch.linspace(-1, 2, mask.numel()).view(mask.shape)

    def grads(plain: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            if plain:
                patch.setattr(chunked_head, "head_slot", lambda model: None)
            model.zero_grad()
            logp, entropy = completion_logprobs(model, *batch, SAMPLINGS[name], with_entropy=True)
            ((logp + 3.0 * entropy) * weights * mask).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    got, want = grads(plain=False), grads(plain=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    with monkeypatch.context() as patch:  # the entropy's share of the gradient is not small
        patch.setattr(chunked_head, "head_slot", lambda model: None)
        model.zero_grad()
        logp, _ = completion_logprobs(model, *batch, SAMPLINGS[name])
        (logp * weights * mask).sum().backward()
    assert (got[0] - model.get_input_embeddings().weight.grad).abs().max() > 1e-3
