"""ClusterGen (the SubGen paper, Sec. 3.2): greedy k-center centres + recent window, one-shot and block-wise."""

import itertools

import pytest
import torch

import kvcompress as kvc
from kvcompress.methods.budget import stream_split
from kvcompress.methods.clustergen import ClusterGenState
from kvcompress.methods.budget import DEFAULT_SLACK
from kvcompress.methods import clustergen
from kvcompress.methods.clustergen import block_centres, farthest_point, squared_distances, squared_norms

torch.set_num_threads(1)


def blobs(n, clusters=8, d=16, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(heads, clusters, d, generator=g) * 4
    labels = torch.randint(0, clusters, (heads, n), generator=g)
    labels[:, :clusters] = torch.arange(clusters)
    keys = centres.gather(1, labels[..., None].expand(-1, -1, d)) + 0.05 * torch.randn(heads, n, d, generator=g)
    return keys[None], torch.randn(1, heads, n, d, generator=g), labels


def test_greedy_radius_is_within_twice_the_optimum():
    g = torch.Generator().manual_seed(1)
    points = torch.randn(3, 11, 2, generator=g)
    k = 3
    _, nearest = farthest_point(points, k)
    greedy = nearest.amax(-1)
    dist = torch.cdist(points, points)
    for row in range(3):
        best = min(float(dist[row][:, list(c)].amin(-1).amax()) for c in itertools.combinations(range(11), k))
        assert float(greedy[row]) <= 2 * best + 1e-6


def test_one_centre_per_cluster_plus_exact_window():
    keys, values, labels = blobs(400)
    window = 32
    summ = kvc.compress("clustergen", keys, values, budget=8, window=window, block_size=None)
    assert summ.num_slots == 8 + window
    centres = summ.positions[..., :8]
    for h in range(2):
        assert len(labels[h, centres[0, h]].unique()) == 8
    assert torch.equal(summ.positions[..., 8:], torch.arange(400 - window, 400).expand(1, 2, window))
    assert torch.equal(summ.log_weights, torch.zeros(1, 2, 8 + window))
    assert torch.equal(summ.keys[..., :8, :], keys[0, torch.arange(2)[:, None], centres[0]][None])


def test_block_local_centres_are_each_blocks_own_greedy_k_center():
    keys, _, _ = blobs(1000, clusters=12, d=8, heads=2, seed=4)
    points = keys[0]
    index = block_centres(points, 250, 256)
    assert index.shape == (2, 250)
    blocks = index // 256
    # quota of block j: floor(250 * C_j / 1000) - floor(250 * C_{j-1} / 1000), C_j = min(256 (j+1), 1000)
    assert (torch.bincount(blocks[0], minlength=4) == torch.tensor([64, 64, 64, 58])).all()
    for j, quota in enumerate([64, 64, 64, 58]):
        block = points[:, 256 * j : 256 * (j + 1)]
        own, _ = farthest_point(block, quota)
        assert torch.equal(index[blocks == j].reshape(2, quota), own + 256 * j)
    assert len(index[0].unique()) == 250


def test_defaults_follow_the_seed_no_sinks():
    keys, values, _ = blobs(300)
    summ = kvc.compress("clustergen", keys, values, compression_ratio=0.5)
    assert summ.num_slots == 150
    assert torch.equal(summ.positions[..., -64:], torch.arange(236, 300).expand(1, 2, 64))


def test_weighted_centres_stand_for_their_nearest_keys():
    keys, values, labels = blobs(300)
    summ = kvc.compress("clustergen", keys, values, budget=8, window=0, weighted=True, block_size=None)
    assert torch.allclose(summ.total_weight(), torch.full((1, 2), 300.0, dtype=torch.float64))
    for h in range(2):
        sizes = torch.bincount(labels[h], minlength=8).double()
        order = labels[h, summ.positions[0, h]]
        assert torch.allclose(summ.log_weights[0, h].double().exp(), sizes[order])


def test_weighted_centres_do_not_move_with_a_common_shift_of_the_keys():
    """Attention ignores a shift shared by every key, and so do the centres and their sizes: with keys of norm about
    2.4e4 the distances' |x|^2 + |c|^2 - 2<x, c> lost its digits and emptied most centres (log-weight -inf)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 1, 2048, 64, generator=g), torch.randn(1, 1, 2048, 64, generator=g)
    plain = kvc.compress("clustergen", keys, values, budget=128, sink=0, window=0, weighted=True)
    shifted = kvc.compress("clustergen", keys + 3000.0, values, budget=128, sink=0, window=0, weighted=True)
    assert torch.equal(shifted.positions, plain.positions) and torch.equal(shifted.log_weights, plain.log_weights)


def test_repeated_keys_are_never_chosen_twice():
    base = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(3))
    keys = base.repeat(1, 1, 10, 1)
    summ = kvc.compress("clustergen", keys, keys.clone(), budget=6, window=0)
    assert len(summ.positions[0, 0].unique()) == 6


def test_blockwise_stream_keeps_every_cluster_within_budget():
    """The re-compression slack comes out of the budget: a budget of 12 re-clusters back to its target of 8 centres, one
    per cluster, and fills the room beside them with the newest tokens."""
    keys, values, labels = blobs(600)
    budget = 12
    target, _ = stream_split(budget, DEFAULT_SLACK)
    assert target == 8  # the clusters
    st = kvc.stream("clustergen", budget=budget, window=16, seed=0, block_size=None)
    for start in range(0, 600, 50):
        st.update(keys[:, :, start : start + 50], values[:, :, start : start + 50])
        assert target <= st.state.slots.length <= budget and st.state.peak_slots <= budget  # never past the budget
    st.compact()
    summ = st.summary()
    assert 8 + 16 <= summ.num_slots <= budget + 16
    for h in range(2):  # the buffer holds the centres of the last re-compression first, then the tokens added since
        assert len(labels[h, summ.positions[0, h, :8]].unique()) == 8
        assert torch.equal(summ.positions[0, h, 8:-16], torch.arange(584 - (summ.num_slots - 8 - 16), 584))


def _farthest_point_per_step(points, k):
    """The previous farthest_point (distances from the Gram matrix at each step), the reference the table form must reproduce."""
    x = points.float()
    g, n, _ = x.shape
    rows = torch.arange(g)
    index = torch.zeros(g, k, dtype=torch.long)
    sq_norms = x.square().sum(-1)
    gram = torch.bmm(x, x.transpose(1, 2))
    dist = lambda c: (sq_norms - 2.0 * gram[rows, c] + sq_norms[rows, c][:, None]).clamp_min(0.0)  # noqa: E731
    nearest = dist(index[:, 0])
    nearest[:, 0] = float("-inf")
    for j in range(1, k):
        nxt = nearest.argmax(dim=-1)
        index[:, j] = nxt
        nearest = torch.minimum(nearest, dist(nxt))
        nearest[rows, nxt] = float("-inf")
    return index


def test_distance_table_reproduces_the_per_step_traversal():
    points = torch.randn(6, 300, 64, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.5, 4, 64)
    assert torch.equal(farthest_point(points, 150)[0], _farthest_point_per_step(points, 150))


def test_squared_distances_and_traversal_take_the_callers_norms(monkeypatch):
    """Squared norms the caller hands on give the same distances, bit for bit, and the same traversal on the table path
    and on the per-step path (a step's centre norm read from the points' own; without them the points are shifted by
    the first, so the distances agree to rounding)."""
    gen = torch.Generator().manual_seed(3)
    points, centres = torch.randn(3, 500, 64, generator=gen) * 2, torch.randn(3, 7, 64, generator=gen)
    given = squared_distances(points, centres, squared_norms(points), squared_norms(centres))
    assert torch.equal(given, squared_distances(points, centres))
    torch.testing.assert_close(given, torch.cdist(points, centres).square(), rtol=1e-4, atol=1e-3)
    valid = torch.rand(3, 500, generator=gen) < 0.7
    valid[:, 0] = True
    for max_gram in (clustergen._MAX_GRAM, 0):  # the table of every pair, then one matrix-vector product per step
        monkeypatch.setattr(clustergen, "_MAX_GRAM", max_gram)
        own, handed = farthest_point(points, 40, valid), farthest_point(points, 40, valid, squared_norms(points))
        assert torch.equal(own[0], handed[0])
        torch.testing.assert_close(own[1], handed[1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("n,budget,block,equal", [(1000, 250, 128, True), (777, 500, 50, True), (600, 8, 50, False), (3000, 1500, 128, True),
                                                 (300, 400, 64, True)])
def test_stream_equals_one_shot_on_the_tokens_seen(n, budget, block, equal):
    """Native stream (block_size 256): the summary is the one-shot block-local k-center at the stream's target, with
    runs of the stream's length (`ClusterGenState.within`: the budget less the room beside the target, runs shortened to
    the room), and the stream never stores more than its budget. equal False: the runs are so short (3 tokens at budget
    8) that run quotas go to 0 and back as n grows (floor rounding), and a run trimmed to 0 lost its slot (the exception
    `ClusterGenState` names): the summary is then a subset of the one-shot's, each run a prefix of the same traversal."""
    g = torch.Generator().manual_seed(n)
    keys, values = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    st = kvc.stream("clustergen", budget=budget, sink=0, window=0)
    target, room = stream_split(budget, DEFAULT_SLACK)
    run = min(256, room)
    assert (st.state.budget, st.state.block_size, st.state.slack_slots) == (target, run, room - run)
    for start in range(0, n, block):
        st.update(keys[:, :, start : start + block], values[:, :, start : start + block])
        stored = sum(r.length for r in st.state.runs)
        held = stored + sum(r.length for r in st.state.waiting) + (st.state.pending.length if st.state.pending is not None else 0)
        assert stored <= target and held <= budget and (st.state.pending is None or st.state.pending.length < run)
    # at most `budget` tokens seen: the stream holds them exactly, which is the one-shot at its budget
    one = kvc.compress("clustergen", keys, values, budget=budget if n <= budget else target, sink=0, window=0, block_size=run)
    got = st.summary()
    if equal:
        for a, b in ((got.positions, one.positions), (got.keys, one.keys), (got.values, one.values), (got.log_weights, one.log_weights)):
            assert torch.equal(a, b)
    else:
        assert 0 < got.positions.shape[-1] <= one.positions.shape[-1] == target
        index = torch.searchsorted(one.positions, got.positions)
        assert torch.equal(one.positions.gather(-1, index), got.positions)
        for a, b in ((got.keys, one.keys), (got.values, one.values)):
            assert torch.equal(a, b.gather(2, index[..., None].expand(-1, -1, -1, b.shape[-1])))
        assert torch.equal(got.log_weights, torch.zeros_like(got.log_weights))


def test_half_precision_and_bad_parameter():
    keys, values, _ = blobs(200)
    summ = kvc.compress("clustergen", keys.half(), values.half(), budget=8, window=8)
    assert summ.keys.dtype == torch.float16
    with pytest.raises(ValueError, match="no parameter"):
        kvc.compress("clustergen", keys, values, budget=8, k=3)
    with pytest.raises(ValueError, match="block_size"):
        kvc.compress("clustergen", keys, values, budget=8, block_size=0)


@pytest.mark.e2e
def test_generate_on_the_default_model(default_model):
    """ClusterGen through kvc.generate keeps (1 - ratio) of the context: centres + recent window."""
    from kvcompress.eval.tasks import line_retrieval

    model, tok = default_model
    sample = line_retrieval(target_tokens=400, depth=0.5, seed=0, tokenizer=tok)
    res = kvc.generate(model, tok, sample.context, sample.question, method="clustergen", compression_ratio=0.5,
                       max_new_tokens=4, progress=False)
    kept = -(-res.context_tokens // 2)
    exact_after = res.prompt_tokens - res.context_tokens + len(res.token_ids) - 1
    assert res.slots_per_layer == [kept + exact_after] * len(res.slots_per_layer)
    assert res.kv_bytes < 0.6 * res.kv_bytes_full


@pytest.mark.parametrize("slack", [pytest.param(0.0, marks=pytest.mark.e2e), 0.5, 2.0])  # slack 0 re-compresses at every token: slow
def test_stream_waiting_runs_change_no_kept_slot(slack):
    """The stream stays within its budget: traversed runs keep the target (`budget.stream_split`), the run in progress
    and the waiting runs (exact, up to `slack_slots` tokens, then one batched traversal) fill the room beside it; the
    waiting changes no kept slot (the same as a state with the same target and runs that traverses every run at once)."""
    g = torch.Generator().manual_seed(11)
    n, budget = 3000, 700
    keys, values = torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)
    st = kvc.stream("clustergen", budget=budget, sink=0, window=0, slack=slack)
    target, room = stream_split(budget, slack)
    assert st.state.budget == target and st.state.block_size + st.state.slack_slots == room
    reference = kvc.stream("clustergen", budget=budget, sink=0, window=0)  # the same target and runs, no run waiting
    reference.state = ClusterGenState(target, st.state.block_size, 0.0)
    for start in range(0, n, 100):
        st.update(keys[:, :, start : start + 100], values[:, :, start : start + 100])
        assert sum(r.length for r in st.state.waiting) <= st.state.slack_slots
        assert sum(r.length for r in st.state.runs) <= target
        assert st.summary().positions.shape[-1] <= budget
        reference.update(keys[:, :, start : start + 100], values[:, :, start : start + 100])
        assert torch.equal(st.summary().positions, reference.summary().positions)
    st.compact()
    reference.compact()
    assert st.state.waiting == [] and sum(r.length for r in st.state.runs) <= target
    for a, b in ((st.summary().positions, reference.summary().positions), (st.summary().keys, reference.summary().keys)):
        assert torch.equal(a, b)
