"""The weight-sync layout (issue 36): the transport names are spelled once (`shared_schemas.sync`) and used
by every schema and registry of both ends, and the server's staging state machine never branches on the
transport (each transport's steps are its receiver's, `rollout_server.weights.receivers`)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from shared_schemas.sync import COLLECTIVE_BACKENDS, TRANSPORT_NAMES

REPO = Path(__file__).resolve().parents[2]
STAGING = REPO / "rollout_server" / "weights" / "staging.py"


def test_every_schema_and_registry_takes_the_one_list_of_names() -> None:
    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.group_send import CollectiveSender
    from learner.weights.sync import SyncConfig
    from learner.weights.transports import TRANSPORTS
    from learner.weights.types import SyncReport
    from rollout_server.engines.base import Rendezvous
    from rollout_server.weights.receivers import RECEIVERS
    from shared_schemas.sync import CollectiveSpec

    assert TRANSPORT_NAMES == ("http", "shm", "gloo", "nccl") and COLLECTIVE_BACKENDS == ("gloo", "nccl")
    assert get_args(SyncConfig.model_fields["transport"].annotation) == TRANSPORT_NAMES
    assert get_args(get_type_hints(ServerRolloutSource.__init__)["transport"]) == TRANSPORT_NAMES
    assert get_args(get_type_hints(SyncReport)["transport"]) == (*TRANSPORT_NAMES, "in_process")
    assert get_args(CollectiveSpec.model_fields["backend"].annotation) == COLLECTIVE_BACKENDS
    assert get_args(get_type_hints(Rendezvous)["backend"]) == COLLECTIVE_BACKENDS
    assert get_args(get_type_hints(CollectiveSender.__init__)["backend"]) == COLLECTIVE_BACKENDS
    assert tuple(sorted(TRANSPORTS)) == tuple(sorted(RECEIVERS)) == tuple(sorted(TRANSPORT_NAMES))


@pytest.mark.parametrize("registry", ["learner.weights.transports", "rollout_server.weights.receivers"])
def test_a_registry_refuses_a_name_not_in_the_list(registry: str) -> None:
    module = __import__(registry, fromlist=["register"])
    with pytest.raises(ValueError, match="is not one of"):
        module.register("udp")


def test_no_other_module_spells_the_names_in_a_literal() -> None:
    names = "|".join(TRANSPORT_NAMES)
    spelled = re.compile(rf"Literal\[[^\]]*[\"'](?:{names})[\"']")
    offenders = [
        str(path.relative_to(REPO))
        for package in ("learner", "rollout_server", "shared_schemas")
        for path in sorted((REPO / package).rglob("*.py"))
        if path != REPO / "shared_schemas" / "sync.py" and spelled.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_the_staging_state_machine_never_names_a_transport() -> None:
    """No transport name as a string, no concrete receiver class, no type test: every transport-specific step
    is a method of the sync's receiver."""
    from rollout_server.weights import receivers

    tree = ast.parse(STAGING.read_text(encoding="utf-8"))
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert strings.isdisjoint(TRANSPORT_NAMES)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    concrete = {
        name for name, obj in vars(receivers).items() if inspect.isclass(obj) and name.endswith("Receiver")
    }
    assert concrete - {"Receiver"} and names.isdisjoint(concrete - {"Receiver"})
    assert "isinstance" not in names
    assert len(STAGING.read_text(encoding="utf-8").splitlines()) < 500


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any level (TYPE_CHECKING and function bodies included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return found


def test_learner_weights_never_import_learner_rollout() -> None:
    """One direction only: `learner.rollout` uses the weight sync (its sources hand updates to it), the weight
    sync names what it needs of them as protocols (`SyncClient`, `SyncTarget`)."""
    offenders = {
        str(path.relative_to(REPO)): sorted(m for m in _imports(path) if m.startswith("learner.rollout"))
        for path in sorted((REPO / "learner" / "weights").rglob("*.py"))
    }
    assert {path: found for path, found in offenders.items() if found} == {}


def test_the_receiver_interface_is_five_verbs_and_imports_no_receiver() -> None:
    from rollout_server.weights.receivers import Receiver

    verbs = {name for name, obj in vars(Receiver).items() if callable(obj) and not name.startswith("_")}
    assert verbs == {"begin", "receive", "prepare", "commit", "abort"}
    base = REPO / "rollout_server" / "weights" / "receivers" / "base.py"
    concrete = {"files", "http", "shm", "gloo_nccl"}
    assert {
        m.rsplit(".", 1)[-1] for m in _imports(base) if m.startswith("rollout_server.weights.receivers")
    }.isdisjoint(concrete)
