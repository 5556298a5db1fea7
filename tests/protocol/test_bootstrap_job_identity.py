"""Two jobs that chose one rendezvous name end refused or each wired to its own ranks, never
crossed: without a token and without a launcher that names the job every rank refuses to
start; with tokens or a launcher's job ids, real processes started in random orders (and a
leftover rank of an earlier job) each see only their own job's bytes and fds."""
import multiprocessing as mp
import os
import time
import uuid

import numpy as np
import pytest

from ep_a2a import bootstrap as bs_mod
from ep_a2a.bootstrap import BootstrapError, NoJobTokenError, UnixSocketBootstrap
from ep_a2a.bootstrap_identity import launcher_job

_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "SLURM_")
_LAUNCHER_KEYS = ("EP_A2A_JOB_TOKEN", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _bare(environ):
    """`environ` without any launcher's variables or a job token (as a shell started by hand)."""
    return {k: v for k, v in environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_KEYS}


@pytest.fixture
def bare_env(monkeypatch):
    for k in set(os.environ) - set(_bare(os.environ)):
        monkeypatch.delenv(k)


# -- which launcher variables name a job --------------------------------------------------------


def test_launcher_ids_decide_only_where_they_differ_per_job():
    rng = np.random.default_rng()
    job, step, ns = (str(int(x)) for x in rng.integers(1, 10**9, 3))
    slurm = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": step, "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    ident, what = launcher_job(1, 4, slurm)
    assert ident and job in what and step in what
    assert launcher_job(1, 2, slurm)[0] and launcher_job(1, 2, slurm)[0] != ident  # the node's own ranks
    assert launcher_job(1, 4, {**slurm, "SLURM_STEP_ID": str(int(step) + 1)})[0] != ident  # another srun
    assert launcher_job(1, 4, {**slurm, "SLURM_JOB_ID": job + "7"})[0] != ident
    assert launcher_job(2, 4, slurm)[0] is None                     # not the rank srun started
    for batch in ({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}, {**slurm, "SLURM_STEP_ID": "4294967294"}):
        ident2, why = launcher_job(1, 4, batch)
        assert ident2 is None and "not started by srun" in why

    ompi = {**slurm, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "PMIX_NAMESPACE": f"prterun-h-{ns}@1"}
    ident3, what3 = launcher_job(3, 8, ompi)  # mpirun inside an allocation: mpirun decides
    assert ident3 and "Open MPI" in what3 and ns in what3
    assert launcher_job(1, 4, ompi)[0] is None  # the Slurm ids inherited from outside do not count
    assert launcher_job(3, 8, {**ompi, "PMIX_NAMESPACE": f"prterun-h-{ns}@2"})[0] != ident3
    assert launcher_job(3, 8, {k: v for k, v in ompi.items() if k != "PMIX_NAMESPACE"})[0] is None

    torch = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    ident4, why4 = launcher_job(0, 2, torch)
    assert ident4 is None and "'none'" in why4  # torchrun's default static rendezvous
    run = str(uuid.uuid4())
    ident5, _ = launcher_job(0, 2, {**torch, "TORCHELASTIC_RUN_ID": run})  # --standalone
    assert ident5 and ident5 != launcher_job(0, 2, {**torch, "TORCHELASTIC_RUN_ID": run,
                                                       "TORCHELASTIC_RESTART_COUNT": "1"})[0]
    assert launcher_job(0, 2, {"PMI_RANK": "0", "PMI_SIZE": "2"})[0]  # Hydra: its proxy, our parent here
    ident6, why6 = launcher_job(0, 2, {})
    assert ident6 is None and "no launcher" in why6


def test_no_token_and_no_launcher_refuses_with_how_to_give_one(tmp_path, bare_env):
    with pytest.raises(NoJobTokenError, match=r"new_job_token\(\).*EP_A2A_JOB_TOKEN"):
        UnixSocketBootstrap(1, 2, name="x" + uuid.uuid4().hex[:8], base_dir=tmp_path, timeout=1)
    assert not os.path.exists(tmp_path / f"ep_a2a-{os.getuid()}"), "refused before any socket"
    with UnixSocketBootstrap(0, 1, name="solo", base_dir=tmp_path) as b:  # a group of one meets no one
        assert b.allgather(b"a") == [b"a"] and b.job_source == "a group of one"


# -- real processes -------------------------------------------------------------------------------


def _rank(label, rank, world, name, base_dir, env, delay, timeout, q):
    """One rank of job `label`: meet, allgather the label, pass a memfd holding it; report
    what every rank of the group turned out to be."""
    for k in set(os.environ) - set(_bare(os.environ)):
        del os.environ[k]
    os.environ.update(env)
    time.sleep(delay)
    t0 = time.monotonic()
    try:
        with UnixSocketBootstrap(rank, world, name=name, base_dir=base_dir, timeout=timeout) as b:
            seen = [x.decode() for x in b.allgather(f"{label}/{rank}".encode())]
            fd = os.memfd_create("job")
            os.write(fd, label.encode())
            got = b.allgather_fds([fd])
            os.close(fd)
            seen_fds = []
            for [f] in got:
                seen_fds.append(os.pread(f, 64, 0).decode())
                os.close(f)
            b.barrier()
        q.put((label, rank, "ok", seen, seen_fds, b.job_source))
    except BootstrapError as e:
        q.put((label, rank, type(e).__name__, str(e), time.monotonic() - t0, None))


def _run(ranks, name, base_dir, timeout):
    """ranks: [(label, rank, world, env, delay)]; every process started at once, each sleeping its delay."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(lab, r, w, name, str(base_dir), env, d, timeout, q))
          for lab, r, w, env, d in ranks]
    for p in ps:
        p.start()
    try:
        out = {}
        for _ in ps:
            lab, r, *rest = q.get(timeout=timeout + 30)
            out[lab, r] = rest
    finally:
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in ps), [p.exitcode for p in ps]
    sock_dir = os.path.join(str(base_dir), f"ep_a2a-{os.getuid()}")
    assert not os.path.isdir(sock_dir) or not os.listdir(sock_dir), "socket file left behind"
    return out


def _check_never_crossed(out, jobs):
    """Every job ends all wired (each rank saw exactly its own job's ranks, bytes and fds) or all refused."""
    for label, world in jobs.items():
        mine = [out[label, r] for r in range(world)]
        if all(o[0] == "ok" for o in mine):
            for o in mine:
                assert o[1] == [f"{label}/{r}" for r in range(world)], (label, out)
                assert o[2] == [label] * world, (label, out)
        else:
            assert not any(o[0] == "ok" for o in mine), ("a job half formed", label, out)


def _slurm(job, rank, world):
    return {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world)}


@pytest.mark.parametrize("mode", ["none", "token", "launcher"])
def test_two_jobs_one_name_random_staggered_starts(tmp_path, mode, bare_env):
    """Jobs A and B of two ranks each, one name, the four processes in a fresh random order
    with fresh random gaps: refused (no token, no launcher ids) or each wired to its own."""
    rng = np.random.default_rng()
    name = "j" + uuid.uuid4().hex[:10]
    tokens = {"A": bs_mod.new_job_token(), "B": bs_mod.new_job_token()}
    jobs = {"A": str(int(rng.integers(1, 10**6))), "B": None}
    jobs["B"] = str(int(jobs["A"]) + 1 + int(rng.integers(0, 100)))
    order = rng.permutation(4)
    delays = np.cumsum(rng.choice([0.0, 0.05, 0.3], 4))
    ranks = []
    for slot, i in enumerate(order):
        label, r = "AB"[i // 2], i % 2
        env = {"none": {}, "token": {"EP_A2A_JOB_TOKEN": tokens[label]}, "launcher": _slurm(jobs[label], r, 2)}[mode]
        ranks.append((label, r, 2, env, float(delays[slot])))
    out = _run(ranks, name, tmp_path, timeout=3)
    if mode == "none":
        assert all(o[0] == "NoJobTokenError" for o in out.values()), out
        return
    _check_never_crossed(out, {"A": 2, "B": 2})
    assert any(out[lab, 0][0] == "ok" for lab in "AB"), ("neither job formed", order, delays, out)
    if mode == "launcher":
        assert {o[3] for o in out.values() if o[0] == "ok"} <= {f"Slurm job {jobs[j]}/0" for j in "AB"}


@pytest.mark.parametrize("leftover_rank", [0, 1])
def test_a_leftover_rank_of_an_earlier_job_never_joins(tmp_path, leftover_rank, bare_env):
    """A rank of an earlier job (same name, its own job id) still waits; the new job starts
    after it: a leftover rank 1 is refused and the new job forms; a leftover rank 0 holds the
    name, so the new job is refused (never joined to it) and the leftover times out."""
    name, old, new = "l" + uuid.uuid4().hex[:10], bs_mod.new_job_token(), bs_mod.new_job_token()
    ranks = [("old", leftover_rank, 2, {"EP_A2A_JOB_TOKEN": old}, 0.0),
             ("new", 0, 2, {"EP_A2A_JOB_TOKEN": new}, 0.6), ("new", 1, 2, {"EP_A2A_JOB_TOKEN": new}, 0.6)]
    out = _run(ranks, name, tmp_path, timeout=3)
    _check_never_crossed(out, {"new": 2})
    assert out["old", leftover_rank][0] in ("BootstrapError", "BootstrapTimeout"), out
    if leftover_rank == 1:
        assert out["new", 0][0] == "ok", out
    else:
        assert out["new", 0][0] == "BootstrapError" and "in use" in out["new", 0][1], out
        assert "another job" in out["new", 1][1], out
