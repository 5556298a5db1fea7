"""Which job a rank belongs to when no job token is given: what its launcher says, if enough.

Two jobs that chose one rendezvous name must never join each other's group. A launcher's
variables name the job only where they differ per job, so each is trusted only then:

* torchrun: TORCHELASTIC_RUN_ID is `--rdzv-id`, a fresh uuid under `--standalone`, and
  "none" with the default static rendezvous (the same for every job: not trusted). A
  user's fixed `--rdzv-id` repeats across jobs, so the restart count, the job's store
  (MASTER_ADDR:MASTER_PORT) and the agent process (the workers' parent) join it.
* Open MPI: PMIX_NAMESPACE (5.x, one per mpirun), or the jobid of 4.x (OMPI_MCA_orte_ess_jobid).
* Slurm: SLURM_JOB_ID and SLURM_STEP_ID, one per srun step. A batch script's own step is
  not a launch of ranks (all its processes share it): not trusted.
* PMI launchers (MPICH/Intel MPI Hydra): PMI_RANK and PMI_SIZE but no job id in the
  environment; the ranks of one launch on a node are children of one proxy process, so
  that process (pid and start time) is the identity.

The first of these whose variables are present decides, in that order (the innermost
launcher: ranks started by mpirun inside a Slurm step inherit the step's variables), and
only if it started this process as the rank it joins as (globally or among the node's
ranks): a process that some rank spawned inherits the launcher's variables too, but not as
a rank of its own.
"""
from __future__ import annotations

import os

_NO_STEP = 0xFFFFFFF0  # Slurm's batch, extern, interactive and pending steps number from here up


def _int(environ, key):
    try:
        return int(environ[key])
    except (KeyError, ValueError):
        return None


def _parent() -> str | None:
    """This process's parent as pid@start-time (a reused pid is another process), or None
    for an orphan (its launcher is gone: it is left over from a job, never part of a new one)."""
    ppid = os.getppid()
    if ppid <= 1:
        return None
    try:
        with open(f"/proc/{ppid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"{ppid}@{int(fields[19])}"  # field 22, starttime, counted after the ")" of comm
    except (OSError, IndexError, ValueError):
        return None


def _slurm_local_count(environ) -> int | None:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID."""
    node, spec = _int(environ, "SLURM_NODEID"), environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if node is None or not spec:
        return None
    counts = []
    try:
        for part in spec.split(","):
            n, _, rep = part.partition("(x")
            counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    except ValueError:
        return None
    return counts[node] if 0 <= node < len(counts) else None


def _launchers(environ):
    """(launcher name, its ids or None with why, [(rank, size) it gave this process])."""
    env = environ.get
    if "TORCHELASTIC_RUN_ID" in environ:
        run_id, parent = env("TORCHELASTIC_RUN_ID", ""), _parent()
        if run_id in ("", "none"):
            ids = "TORCHELASTIC_RUN_ID is 'none' (torchrun's default static rendezvous names no job; " \
                  "--standalone or --rdzv-id does)"
        elif parent is None:
            ids = "this worker's torchrun agent is gone"
        else:
            ids = [run_id, env("TORCHELASTIC_RESTART_COUNT", ""), env("MASTER_ADDR", ""), env("MASTER_PORT", ""), parent]
        yield "torchrun", ids, [("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    if "OMPI_COMM_WORLD_SIZE" in environ:
        job = env("PMIX_NAMESPACE") or env("OMPI_MCA_orte_ess_jobid") or env("OMPI_MCA_ess_base_jobid")
        ids = [job] if job else "Open MPI set neither PMIX_NAMESPACE nor a jobid"
        yield "Open MPI", ids, [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")]
    if "PMI_RANK" in environ and "PMI_SIZE" in environ:
        parent = _parent()
        ids = [parent, env("PMI_SIZE")] if parent else "this rank's launcher process is gone"
        yield "PMI (Hydra)", ids, [("PMI_RANK", "PMI_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")]
    if "SLURM_JOB_ID" in environ:
        step = _int(environ, "SLURM_STEP_ID")
        if step is None or step >= _NO_STEP:
            ids = "inside a Slurm job but not started by srun (a batch script's processes share its job and step)"
        else:
            ids = [env("SLURM_CLUSTER_NAME", ""), env("SLURM_JOB_ID"), str(step)]
        yield "Slurm", ids, [("SLURM_PROCID", "SLURM_NTASKS"), ("SLURM_LOCALID", _slurm_local_count)]


def launcher_job(rank: int, world_size: int, environ=None) -> tuple[str | None, str]:
    """(the job's identity as a string, what it is) where this process's launcher names its job
    and started it as `rank` of `world_size`; else (None, why not)."""
    environ = os.environ if environ is None else environ
    for launcher, ids, slots in _launchers(environ):
        if isinstance(ids, str):
            return None, f"{launcher} launched this process, but {ids}"
        given = []
        for rank_key, size_key in slots:
            r = _int(environ, rank_key)
            n = size_key(environ) if callable(size_key) else _int(environ, size_key)
            given.append(f"{r} of {n}")
            if (r, n) == (rank, world_size):
                return "\0".join([launcher, rank_key, *ids]), f"{launcher} job {'/'.join(i for i in ids if i)}"
        return None, (f"{launcher} started this process as rank {' (on this node: '.join(given)}), not as rank "
                      f"{rank} of {world_size}: a group other than the launcher's own ranks needs a token of its own")
    return None, "no launcher that names its jobs (torchrun, srun, mpirun, mpiexec) started this process"
