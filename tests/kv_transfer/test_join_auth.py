"""Authenticated joins over a real TCPStore and real gloo pairs on loopback: the secret never
reaches the store, forged, replayed and pre-answered joins and strangers at a pair's group are
refused while the real pair forms and moves frames, and a flood delays a real join only by the
messages queued ahead of it."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed import PrefixStore

from pdserve.kv_transfer import (
    ChannelConfig,
    TorchDistConnector,
    TransferEndpoint,
    TransferError,
    TransferKey,
)
from pdserve.kv_transfer.rendezvous import (
    ACCEPT_KEY,
    JOIN_KEY,
    MAX_JOIN_BYTES,
    NEXT_KEY,
    PAIR_KEY,
    SESSION_KEY,
    JoinQueue,
    PairJoin,
    SecretJoin,
    SignedStore,
    answer_join,
    master_store,
    new_pair_group,
    new_session,
    pair_store,
    request_pair,
)

SECRET = "0123456789abcdef-cluster-join-secret"
HOST = "127.0.0.1"
IMPATIENT = ChannelConfig(peer_timeout_s=1.5, connect_timeout_s=1.5, heartbeat_s=0.2)




def _leaks_secret(blob: bytes) -> bool:
    secret = SECRET.encode()
    return any(form in blob for form in (secret, secret.hex().encode(), secret[:12]))


def _bogus_joins(session: bytes, num: int) -> list[bytes]:
    """Every kind of message a flood can hold: wrong MAC, oversized, not UTF-8, garbage, a
    right-looking join under another secret, an index never handed out."""
    forger = SecretJoin(b"not-the-secret")
    kinds = [
        lambda i: f"{i + 1} flood-{i} {i:032x} {0:064x}".encode(),
        lambda i: b"9" * (MAX_JOIN_BYTES + 1 + i % 7),
        lambda i: b"\xff\xfe" * 8,
        lambda i: b"garbage",
        lambda i: forger.make(session, 1, f"forger-{i}").message,
        lambda i: SecretJoin(SECRET.encode()).make(session, 10**9 + i, "future").message,
    ]
    return [kinds[i % len(kinds)](i) for i in range(num)]


def _next_join(kv, queue: JoinQueue) -> PairJoin:
    popped: list[PairJoin] = []

    def got_one() -> bool:
        popped.extend(queue.pop_batch(1)[0])
        return bool(popped)

    assert kv.wait_until(got_one, 5)
    return popped[0]


@pytest.fixture
def secured(kv, no_thread_leak):
    """A D endpoint under SECRET (recording sink) and a P connector holding the secret."""
    sink = kv.RecordingSink(kv.make_pool(1))
    endpoint = TransferEndpoint(sink, config=kv.FAST, join_token=SECRET)
    connector = TorchDistConnector("prefill-0", config=kv.FAST, join_token=SECRET)
    yield sink, endpoint, connector
    connector.close()
    endpoint.close()


def test_a_client_popping_the_join_queue_learns_no_secret_and_cannot_answer(kv, no_thread_leak):
    store = master_store(HOST, 0, 5.0)
    store.set(SESSION_KEY, new_session())
    spy = kv.store_client(f"{HOST}:{store.port}")
    outcome: list[TransferError] = []

    def prefill_joins() -> None:
        try:
            request_pair(kv.store_client(f"{HOST}:{store.port}"), SecretJoin(SECRET.encode()),
                         "prefill-0", 1.0)
        except TransferError as exc:
            outcome.append(exc)

    prefill = threading.Thread(target=prefill_joins)
    prefill.start()
    stolen = spy.queue_pop(JOIN_KEY)  # blocks until P pushes: nothing else pops this store
    idx = int(stolen.split(b" ")[0])
    spy.set(f"{ACCEPT_KEY}{idx}", b"1")  # the old answer, on the old key
    prefill.join(10)
    assert not _leaks_secret(stolen)
    assert len(stolen.split(b" ")) == 4  # idx, peer id, nonce, MAC
    assert outcome and "no answer" in str(outcome[0])  # the spy could not answer for D


def test_nothing_in_the_store_holds_the_secret(kv, secured):
    sink, endpoint, connector = secured
    assert kv.transfer_works(endpoint, sink, connector, TransferKey(1, 1))
    spy = kv.store_client(endpoint.address)
    keys = spy.list_keys()
    assert any(key.startswith(PAIR_KEY) for key in keys)  # the pair's rendezvous is there
    for key in keys:
        assert not _leaks_secret(key.encode() + spy.get(key)), key
    assert not any(key.startswith(f"{PAIR_KEY}1/") for key in keys)  # not the guessable one


def test_pre_set_answers_are_ignored_and_the_real_pair_forms(kv, secured):
    sink, endpoint, connector = secured
    spy = kv.store_client(endpoint.address)
    for idx in range(1, 20):  # answers waiting for every index P could take
        spy.set(f"{ACCEPT_KEY}{idx}", b"1")
    assert kv.transfer_works(endpoint, sink, connector, TransferKey(2, 1))
    assert endpoint.peer_ids == ["prefill-0"]


def test_wrong_secret_is_dropped_unanswered(kv, secured):
    sink, endpoint, connector = secured
    stranger = TorchDistConnector("stranger", config=IMPATIENT, join_token="a-good-guess")
    try:
        error = stranger.sender(endpoint.address).send_abort(TransferKey(1, 1)).exception(10)
        assert isinstance(error, TransferError) and "join timeout" in str(error)
        assert endpoint.num_bad_joins == 1 and endpoint.num_peers == 0
        assert kv.transfer_works(endpoint, sink, connector, TransferKey(3, 1))
    finally:
        stranger.close()


def test_a_replayed_join_is_refused(kv, secured):
    sink, endpoint, connector = secured
    raw = kv.store_client(endpoint.address)
    join = request_pair(raw, SecretJoin(SECRET.encode()), "prefill-r", 5.0)
    pg = new_pair_group(pair_store(raw, join), 1, "gloo", HOST, kv.FAST.peer_timeout_s)
    proof = torch.empty(32, dtype=torch.uint8)
    pg.recv([proof], 0, 0).wait()
    pg.send([torch.frombuffer(bytearray(join.prefill_proof), dtype=torch.uint8)], 0, 0).wait()
    assert kv.wait_until(lambda: endpoint.num_peers == 1, 5)
    raw.queue_push(JOIN_KEY, join.message)  # the same join again, word for word
    assert kv.wait_until(lambda: endpoint.num_bad_joins == 1, 5)
    assert not raw.check([join.accept_key])  # never answered a second time
    assert endpoint.num_peers == 1
    del pg  # the replayer's own pair goes; the real one still forms
    assert kv.wait_until(lambda: endpoint.num_peers == 0, 5)
    assert kv.transfer_works(endpoint, sink, connector, TransferKey(4, 1))


def test_a_stranger_at_the_guessable_group_prefix_never_meets_anyone(kv, secured):
    sink, endpoint, connector = secured
    failures: list[Exception] = []

    def squat(idx: int) -> None:  # waits as P (rank 1) where the old protocol met D
        store = PrefixStore(f"{PAIR_KEY}{idx}/", kv.store_client(endpoint.address, 1.5))
        try:
            new_pair_group(store, 1, "gloo", HOST, 1.5)
        except Exception as exc:  # nobody else ever came
            failures.append(exc)

    squatters = [threading.Thread(target=squat, args=(idx,)) for idx in (1, 2)]
    for t in squatters:
        t.start()
    try:
        assert kv.transfer_works(endpoint, sink, connector, TransferKey(5, 1))
    finally:
        for t in squatters:
            t.join(10)
    assert len(failures) == 2
    assert endpoint.num_failed_handshakes == 0 and not sink.lost


def test_forged_values_at_the_pair_prefix_do_not_read(kv, no_thread_leak):
    store = master_store(HOST, 0, 2.0)
    join = SecretJoin(SECRET.encode()).make(new_session(), 1, "prefill-0")
    signed = pair_store(store, join)
    assert isinstance(signed, SignedStore)
    signed.set("0/0", b"an address")
    assert signed.get("0/0") == b"an address"
    raw = PrefixStore(join.pair_prefix, kv.store_client(f"{HOST}:{store.port}"))
    raw.set("0/1", b"the stranger's address" + bytes(32))
    raw.set("0/2", raw.get("0/0"))  # a genuine value moved to another key
    for key in ("0/1", "0/2"):
        with pytest.raises(TransferError, match="not the pair's"):
            signed.get(key)


def test_a_peer_that_cannot_prove_the_secret_is_dropped(kv, secured):
    sink, endpoint, connector = secured
    raw = kv.store_client(endpoint.address)
    join = request_pair(raw, SecretJoin(SECRET.encode()), "intruder", 5.0)  # got in somehow
    pg = new_pair_group(pair_store(raw, join), 1, "gloo", HOST, kv.FAST.peer_timeout_s)
    proof = torch.empty(32, dtype=torch.uint8)
    pg.recv([proof], 0, 0).wait()
    pg.send([torch.zeros(32, dtype=torch.uint8)], 0, 0).wait()  # not the prefill proof
    assert kv.wait_until(lambda: endpoint.num_failed_handshakes == 1, 5)
    assert kv.wait_until(lambda: endpoint.num_peers == 0, 5)
    assert not sink.lost  # the sink never saw the intruder
    del pg
    assert kv.transfer_works(endpoint, sink, connector, TransferKey(6, 1))


def test_prefill_sends_nothing_to_an_endpoint_that_cannot_prove_the_secret(kv, no_thread_leak):
    store = master_store(HOST, 0, 5.0)
    session = new_session()
    store.set(SESSION_KEY, session)
    address = f"{HOST}:{store.port}"
    connector = TorchDistConnector("prefill-0", config=IMPATIENT, join_token=SECRET)
    sent = connector.sender(address).send_abort(TransferKey(1, 1))
    join = _next_join(kv, JoinQueue(store, SecretJoin(SECRET.encode()), session))
    answer_join(store, join, True)
    pg = new_pair_group(pair_store(kv.store_client(address), join), 0, "gloo", HOST, 1.5)
    pg.send([torch.zeros(32, dtype=torch.uint8)], 1, 0).wait()  # not the decode proof
    error = sent.exception(10)
    assert isinstance(error, TransferError) and "did not prove" in str(error)
    heard = torch.empty(32, dtype=torch.uint8)
    with pytest.raises(RuntimeError):  # P closed the pair without a word
        pg.recv([heard], 1, 0).wait()
    connector.close()


def test_an_answer_that_does_not_verify_is_refused(kv, no_thread_leak):
    store = master_store(HOST, 0, 5.0)
    session = new_session()
    store.set(SESSION_KEY, session)
    connector = TorchDistConnector("prefill-0", config=IMPATIENT, join_token=SECRET)
    sent = connector.sender(f"{HOST}:{store.port}").send_abort(TransferKey(1, 1))
    join = _next_join(kv, JoinQueue(store, SecretJoin(SECRET.encode()), session))
    store.set(join.accept_key, b"1")  # someone who read the key's name overwrote the answer
    error = sent.exception(10)
    assert isinstance(error, TransferError) and "does not verify" in str(error)
    connector.close()


def test_a_real_join_waits_behind_exactly_the_messages_ahead_of_it(kv, no_thread_leak):
    store = master_store(HOST, 0, 5.0)
    session = new_session()
    client = kv.store_client(f"{HOST}:{store.port}")
    num_ahead, num_behind = 600, 120
    for message in _bogus_joins(session, num_ahead):
        client.queue_push(JOIN_KEY, message)
    real = SecretJoin(SECRET.encode()).make(session, client.add(NEXT_KEY, 1), "prefill-0")
    client.queue_push(JOIN_KEY, real.message)
    for message in _bogus_joins(session, num_behind):
        client.queue_push(JOIN_KEY, message)
    assert client.queue_len(JOIN_KEY) == num_ahead + 1 + num_behind
    queue = JoinQueue(store, SecretJoin(SECRET.encode()), session)
    joins, is_empty = queue.pop_batch(num_ahead + 1)  # the real join is the last of these
    assert [j.message for j in joins] == [real.message] and not is_empty
    assert queue.num_bad_joins == num_ahead
    assert queue.pop_batch(10 * num_behind) == ([], True)
    assert queue.num_bad_joins == num_ahead + num_behind


def test_a_flood_ahead_of_a_real_join_does_not_keep_it_out(kv, secured):
    sink, endpoint, connector = secured
    flood = kv.store_client(endpoint.address)
    session = flood.get(SESSION_KEY)
    num_ahead = 3000  # one message per listener poll would take 60 s: P waits 5 s at most
    for message in _bogus_joins(session, num_ahead):
        flood.queue_push(JOIN_KEY, message)
    flood.queue_len(JOIN_KEY)  # a round trip: the store has every push before P's join
    assert kv.transfer_works(endpoint, sink, connector, TransferKey(7, 1))
    assert endpoint.num_bad_joins == num_ahead
    assert endpoint.peer_ids == ["prefill-0"]
