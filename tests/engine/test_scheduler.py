from formcast.engine.block_manager import BlockManager
from formcast.engine.scheduler import Scheduler
from formcast.engine.sequence import SequenceStatus

from .helpers import make_seq


def run_step(sched: Scheduler, sample_token: int = 7):
    """Pretend the model ran: mark tokens computed and append a token where sampled."""
    plan = sched.schedule()
    sampled = [item.seq for item in plan.scheduled if item.samples]
    sched.on_step_done(plan)
    for seq in sampled:
        seq.token_ids.append(sample_token)
    return plan


def test_prefill_then_decode_one_token_per_step():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(list(range(10)))
    sched.add(seq)
    plan = run_step(sched)
    assert [(i.seq.request_id, i.num_tokens) for i in plan.scheduled] == [("r", 10)]
    plan = run_step(sched)
    assert [i.num_tokens for i in plan.scheduled] == [1]
    assert seq.num_computed_tokens == 11 and len(seq) == 12


def test_chunked_prefill_respects_token_budget_and_samples_only_at_the_end():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=4)
    seq = make_seq(list(range(10)))
    sched.add(seq)
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        chunks.append((plan.scheduled[0].num_tokens, plan.scheduled[0].samples))
        sched.on_step_done(plan)
    assert chunks == [(4, False), (4, False), (2, True)]


def test_continuous_batching_admits_new_requests_while_others_decode():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = make_seq(list(range(5)), rid="a")
    sched.add(a)
    run_step(sched)
    b = make_seq(list(range(20, 27)), rid="b")
    sched.add(b)
    plan = run_step(sched)
    assert [(i.seq.request_id, i.num_tokens) for i in plan.scheduled] == [("a", 1), ("b", 7)]
    sched.finish(a, "stop")
    plan = run_step(sched)
    assert [(i.seq.request_id, i.num_tokens) for i in plan.scheduled] == [("b", 1)]
    assert a.status is SequenceStatus.FINISHED and a.block_table == []


def test_max_num_seqs_limits_the_running_batch():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(make_seq([1, 2, 3], rid=str(i)))
    plan = run_step(sched)
    assert len(plan.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    # 4 blocks of 2 tokens: two sequences of 3 tokens take 2 blocks each
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq([1, 2, 3], rid="a"), make_seq([4, 5, 6], rid="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)          # both prefilled: 4 tokens each, 3 computed
    run_step(sched)          # 5 tokens each, 4 computed: both blocks full
    run_step(sched)          # a needs a 3rd block: b is preempted
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert sched.num_preemptions == 1
    assert b.token_ids == [4, 5, 6, 7, 7]    # generated tokens survive, only KV is dropped
    sched.finish(a, "stop")
    plan = run_step(sched)
    assert [(i.seq.request_id, i.num_tokens) for i in plan.scheduled] == [("b", 5)]


def test_a_lone_sequence_never_preempts_itself_when_it_fits():
    bm = BlockManager(3, 2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq([1, 2, 3])
    sched.add(seq)
    for _ in range(3):
        run_step(sched)
    assert len(seq) == 6 and seq.status is SequenceStatus.RUNNING
    assert sched.num_preemptions == 0


def test_waiting_request_with_cached_prefix_skips_computed_tokens():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_seq(list(range(13)), rid="a")
    sched.add(a)
    run_step(sched)
    b = make_seq(list(range(13)), rid="b")
    sched.add(b)
    plan = run_step(sched)
    assert [(i.seq.request_id, i.num_tokens) for i in plan.scheduled] == [("a", 1), ("b", 1)]
    assert b.num_cached_prompt_tokens == 12


def test_a_refused_pick_masks_its_request_until_more_agreements_as_refusals_repeat():
    """Masks serve a request whose unmasked pick was refused until 2 masked picks
    in a row are its unmasked argmax, then 4, 8 and at most 16 as refusals
    repeat (its engine resets the streak once a pick is taken); a disagreement
    asks for as many again, 1 for a request never refused. Each change of the
    way it samples moves the count of its epochs (shared by
    an engine's sequences)."""
    from formcast.engine.sequence import SamplingEpochs, Sequence

    epochs = SamplingEpochs()
    seq = make_seq([1, 2, 3], epochs=epochs)
    seq.masked_pick_seen(True)  # (unmasked: an agreement changes nothing)
    assert not seq.masked and seq.agreements_due == 0
    epoch = epochs.sampling
    seq.masked_pick_seen(False)
    assert seq.masked and seq.agreements_due == 1 and epochs.sampling == epoch + 1
    seq.masked_pick_seen(True)
    assert not seq.masked and epochs.sampling == epoch + 2
    due = []
    for _ in range(6):
        seq.pick_refused()
        due.append(seq.agreements_due)
        assert seq.masked
    assert due == [2, 4, 8, 16, 16, 16]
    seq.masked_pick_seen(True)
    seq.masked_pick_seen(False)  # (a disagreement: as many again)
    assert seq.agreements_due == 16
    seq.refusal_streak = 0  # (a pick taken)
    seq.pick_refused()
    assert seq.agreements_due == 2
    epoch = epochs.sampling
    seq.masked_pick_seen(True)
    assert seq.masked and epochs.sampling == epoch
    seq.masked_pick_seen(True)
    assert not seq.masked and epochs.sampling == epoch + 1
    # a step's misses in one loop: as one by one, the epoch moved once if any changed
    rows = [make_seq([1, 2, 3], epochs=epochs) for _ in range(3)]
    rows[1].masked_pick_seen(False)
    rows[2].refusal_streak = 3
    epoch = epochs.sampling
    Sequence.masked_picks_missed(iter(rows))
    assert [(s.masked, s.agreements_due) for s in rows] == [(True, 1), (True, 1), (True, 8)]
    assert epochs.sampling == epoch + 1
    Sequence.masked_picks_missed(rows)
    assert epochs.sampling == epoch + 1  # (no way changed)
    bans = epochs.bans
    rows[0].ban(4, 7)  # (a ban changes the way too)
    assert (epochs.sampling, epochs.bans) == (epoch + 2, bans + 1)
    assert make_seq([1]).epochs is not epochs  # (a sequence of no engine counts its own)
