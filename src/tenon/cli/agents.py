"""`tenon agents`: the agents a state directory holds, and unblocking or discarding one.

    tenon agents [--state-dir DIR]          list: state, generation, last committed boundary
    tenon agents unblock ID [--state-dir]   let a blocked agent run again (controller stopped)
    tenon agents discard ID [--state-dir]   destroy what exists, delete record and workspace

Listing reads the recovery store and works beside a running controller; unblock and discard
change what a controller acts on, so they take the state directory's lock and refuse while a
controller holds it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tenon.cli.console import make_console
from tenon.cli.errors import one_line
from tenon.errors import TenonError
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.statedir import (
    DEFAULT_STATE_DIR,
    DOMAIN_FILE,
    RECOVERY_DB,
    StateDirBusy,
    holder_pid,
    is_locked,
    locked,
)
from tenon.state.workspace import WorkspaceStore

agents_app = typer.Typer(help="Agents in the state directory: list, unblock, discard.")
_stderr = Console(stderr=True, soft_wrap=True, highlight=False)

# Exit status when the state directory refuses the request (unknown agent, not blocked,
# a controller running); 2 stays for malformed input.
EXIT_REFUSED = 1

StateDirOption = Annotated[Path, typer.Option("--state-dir", help="The runtime's state directory.")]
AgentId = Annotated[str, typer.Argument(help="The agent's id (see `tenon agents`).")]


def _refuse(message: str) -> NoReturn:
    _stderr.print(Text("error: ", style="red") + Text(one_line(message)))
    raise typer.Exit(EXIT_REFUSED)


def _store(state_dir: Path) -> RecoveryStore:
    path = state_dir / RECOVERY_DB
    if not path.exists():
        _refuse(f"no recovery store at {path}: no controller has used {state_dir}")
    return RecoveryStore(path)


def _record(store: RecoveryStore, agent_id: str, state_dir: Path) -> RecoveryRecord:
    record = store.get(agent_id)
    if record is None:
        _refuse(f"unknown agent {agent_id!r} in {state_dir} (`tenon agents` lists them)")
    return record


def _when(wall_s: float | None) -> str:
    if wall_s is None:
        return "-"
    return datetime.datetime.fromtimestamp(wall_s, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def agents_table(records: list[RecoveryRecord]) -> Table:
    table = Table()
    for name in ("agent", "state", "gen", "actions", "restartable"):  # never cut these short
        table.add_column(name, no_wrap=True)
    for name in ("last committed", "digest", "in flight / interrupted", "blocked reason"):
        table.add_column(name, overflow="fold")
    for r in records:
        share = f"{r.num_restartable}/{r.num_actions}" if r.num_actions else "-"
        state = {"blocked": "[red]blocked[/red]", "torn_down": "torn down"}.get(r.state, r.state)
        flight = r.in_flight or (f"{r.interrupted} (interrupted)" if r.interrupted else "-")
        table.add_row(r.agent_id, state, str(r.generation), str(r.num_actions), share,
                      _when(r.committed_at), (r.manifest_digest or "-")[:12], flight,
                      r.reason if r.state == "blocked" else "")
    return table


@agents_app.callback(invoke_without_command=True)
def agents_list(ctx: typer.Context, state_dir: StateDirOption = DEFAULT_STATE_DIR) -> None:
    """List every agent with its residency state, last committed boundary and block reason."""
    if ctx.invoked_subcommand is not None:
        return
    console = make_console()  # sized by the terminal (or COLUMNS) of this invocation
    path = state_dir / RECOVERY_DB
    running = is_locked(state_dir) if state_dir.is_dir() else False
    pid = holder_pid(state_dir) if running else None
    console.print(f"state directory {state_dir}: controller "
                  f"{f'running (pid {pid})' if running else 'not running'}")
    if not path.exists():
        console.print("no agents (no recovery store yet)")
        return
    store = RecoveryStore(path)
    try:
        records = store.all()
    except TenonError as exc:
        _refuse(str(exc))
    finally:
        store.close()
    if not records:
        console.print("no agents")
        return
    console.print(agents_table(records))


@contextlib.contextmanager
def _exclusive(state_dir: Path) -> Iterator[None]:
    """Hold the state directory's lock; refused (exit 1) while a controller runs."""
    try:
        with locked(state_dir):
            yield
    except StateDirBusy as exc:
        _refuse(str(exc))


@agents_app.command("unblock")
def agents_unblock(agent_id: AgentId, state_dir: StateDirOption = DEFAULT_STATE_DIR) -> None:
    """Let a blocked agent run again, from its persistent root as it is on disk.

    If the root still matches the last committed manifest, the record is simply torn down
    again; otherwise (its sandbox was lost with live state, or the root changed) the root as
    it is now is captured and committed: what was lost outside it stays lost.
    """
    console = make_console()
    with _exclusive(state_dir):
        store = _store(state_dir)
        try:
            record = _record(store, agent_id, state_dir)
            if record.state != "blocked":
                _refuse(f"agent {agent_id} is not blocked (it is {record.state})")
            workspaces = _workspaces(state_dir)
            workspaces.attach(agent_id)
            if record.manifest_digest is not None:
                try:
                    workspaces.verify(agent_id, record.manifest_digest, record.manifest)
                except TenonError as exc:
                    console.print(f"workspace changed since the last commit: {exc}")
                else:
                    store.unblock(agent_id)
                    console.print(f"agent {agent_id} unblocked: its workspace matches the "
                                  f"committed digest {record.manifest_digest[:12]}")
                    return
            manifest = workspaces.capture(agent_id)
            store.commit_teardown(agent_id, record.generation, manifest.digest,
                                  record.base_image, record.backend, record.backend_config,
                                  manifest=manifest)
            console.print(f"agent {agent_id} unblocked: committed its workspace as it is on "
                          f"disk (digest {manifest.digest[:12]}); was blocked: {record.reason}")
        except TenonError as exc:
            _refuse(f"agent {agent_id}: {exc}")
        finally:
            store.close()


@agents_app.command("discard")
def agents_discard(agent_id: AgentId, state_dir: StateDirOption = DEFAULT_STATE_DIR) -> None:
    """Destroy the agent's leftover sandboxes, delete its record and its workspace."""
    console = make_console()
    with _exclusive(state_dir):
        store = _store(state_dir)
        try:
            record = store.get(agent_id)
            workspaces = _workspaces(state_dir)
            if record is None and not workspaces.path_for(agent_id).exists():
                _refuse(f"unknown agent {agent_id!r} in {state_dir} (`tenon agents` lists them)")
            removed = _destroy_sandboxes(state_dir, agent_id,
                                         record.backend if record else "process")
            store.delete(agent_id)
            workspaces.delete(agent_id)
        except TenonError as exc:
            _refuse(f"agent {agent_id}: {exc}")
        finally:
            store.close()
    console.print(f"agent {agent_id} discarded" +
                  (f" (removed {', '.join(removed)})" if removed else ""))


def _workspaces(state_dir: Path) -> WorkspaceStore:
    from tenon.host.diskfs import DiskLimits

    return WorkspaceStore(state_dir, limits=DiskLimits())


def _destroy_sandboxes(state_dir: Path, agent_id: str, backend: str) -> list[str]:
    """Every sandbox of the agent still on the host: its containers, then its cgroups."""
    from tenon.host.domain import WorkloadDomain
    from tenon.host.layout import detect_layout
    from tenon.sandbox.registry import make_backend

    try:
        name = (state_dir / DOMAIN_FILE).read_text().strip()
    except FileNotFoundError:
        return []
    prefix = f"{agent_id}-g"  # sandbox ids are <agent>-g<generation>-<suffix>
    domain = WorkloadDomain(name, detect_layout(), None)  # adopted, never created here
    removed = make_backend(backend, domain, state_dir).remove_leftovers(prefix)
    for sandbox_id in domain.sandbox_ids():
        if sandbox_id.startswith(prefix):
            domain.sandbox(sandbox_id).remove()
            removed.append(f"cgroup {name}/{sandbox_id}")
    return removed
