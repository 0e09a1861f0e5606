"""GPU slots (``ddtree.server.slots``): how they resolve, how a slot is addressed as a
host, and the one-line refusals naming file and key. Pure: no host is reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ddtree_ops.errors import InventoryError, TargetError
from ddtree_ops.inventory import load_inventory
from ddtree_ops.inventory_types import SlotRef, SlotSettings
from ddtree_ops.probe import GpuInfo, HostFacts, slot_gpu_problem

CORPUS = Path(__file__).resolve().parent / "corpus" / "slots"


def write(tmp_path: Path, server: dict[str, Any], **host: Any) -> Path:
    path = tmp_path / "inv.yaml"
    body = {"ansible_connection": "local", "ddtree": {"run_dir": "/r", "server": server}, **host}
    path.write_text(yaml.safe_dump({"all": {"hosts": {"h": body}}}))
    return path


def test_count_form_is_merged_across_layers_and_derives_gpus_and_ports() -> None:
    inv = load_inventory([CORPUS / "hosts.yml"])
    a = inv.hosts["ct200-a"].ddtree.server  # count from the group, gpus_per_slot from group_vars
    assert a.slots == tuple(SlotSettings(gpus=(2 * i, 2 * i + 1), port=30000 + i) for i in range(4))
    c = inv.hosts["ct200-c"].ddtree.server  # host_vars overrides both keys
    assert c.slots == (SlotSettings((0, 1, 2, 3), 30000), SlotSettings((4, 5, 6, 7), 30001))
    b = inv.hosts["ct200-b"].ddtree.server  # a list replaces the count whole; a missing port is derived
    assert b.slots == (SlotSettings((0, 1), 31000), SlotSettings((6, 7), 30001))


def test_a_slot_is_a_host_with_its_own_port_run_dir_and_gpus() -> None:
    host = load_inventory([CORPUS / "hosts.yml"]).hosts["ct200-b"]
    slots = host.slot_hosts()
    assert [s.name for s in slots] == ["ct200-b/0", "ct200-b/1"]
    one = slots[1]
    assert one.slot == SlotRef(machine="ct200-b", index=1, gpus=(6, 7))
    assert one.machine == "ct200-b" and host.machine == "ct200-b"
    assert one.ddtree.server.port == 30001 and one.ddtree.server.slots == ()
    assert one.ddtree.run_dir == "~/.ddtree-ops/slot-1"
    assert one.ddtree.server.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert one.address == "10.1.0.2" and one.groups == host.groups
    assert one.slot_hosts() == (one,)


def test_a_host_without_slots_is_its_own_slot_and_an_alias_stays_reachable(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {
        "plain": {"ansible_connection": "local"},
        "box": {"ddtree": {"server": {"slots": {"count": 2, "gpus_per_slot": 1}}}},
    }}}))
    inv = load_inventory([path])
    plain = inv.hosts["plain"]
    assert plain.slot_hosts() == (plain,) and plain.slot is None
    # An ssh_config alias is looked up by name; a slot's name is not one, so the
    # machine's name becomes its address.
    assert [s.address for s in inv.hosts["box"].slot_hosts()] == ["box", "box"]


def test_targets_resolve_to_slots_for_servers_and_to_machines_once_for_the_rest() -> None:
    inv = load_inventory([CORPUS / "hosts.yml"])
    names = [h.name for h in inv.resolve_slots("ct200")]
    assert names[:4] == ["ct200-a/0", "ct200-a/1", "ct200-a/2", "ct200-a/3"] and len(names) == 8
    assert [h.name for h in inv.resolve_slots("ct200-b/1")] == ["ct200-b/1"]
    assert [h.name for h in inv.resolve_slots("ct200-b,ct200-b/1")] == ["ct200-b/0", "ct200-b/1"]
    # deploy, doctor, rollback: a slot stands for its machine, once.
    assert [h.name for h in inv.resolve("ct200-b/0,ct200-b/1")] == ["ct200-b"]


def test_an_unknown_slot_names_the_host_and_its_slots(tmp_path: Path) -> None:
    inv = load_inventory([CORPUS / "hosts.yml"])
    with pytest.raises(TargetError, match=r"unknown slot '2' of host 'ct200-b': its slots are ct200-b/0, ct200-b/1$"):
        inv.resolve_slots("ct200-b/2")
    with pytest.raises(TargetError, match="unknown slot '9' of host 'ct200-b'"):
        inv.resolve("ct200-b/9")  # deploy and doctor refuse it as well
    with pytest.raises(TargetError, match="unknown slot '00' of host 'ct200-a': its slots are ct200-a/0, "):
        inv.resolve_slots("ct200-a/00")
    plain = load_inventory([write(tmp_path, {})])
    with pytest.raises(TargetError, match="unknown slot '0' of host 'h': it has no ddtree.server.slots"):
        plain.resolve_slots("h/0")


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"slots": [{"gpus": "0,1"}, {"gpus": "1,2"}]},
         "h.ddtree.server.slots: GPU 1 is in slot 0 and slot 1; slots must not share GPUs"),
        ({"port": 30000, "slots": [{"gpus": "0", "port": 30001}, {"gpus": "1"}]},
         "h.ddtree.server.slots: port 30001 is used by slot 0 and slot 1"),
        ({"slots": {"count": 2, "gpus_per_slot": 2}, "extra_args": ["--tp-size", "4"]},
         "h.ddtree.server.extra_args: --tp-size 4 does not match slot 0's 2 GPU(s) (0,1)"),
        ({"slots": [{"gpus": "0,1"}, {"gpus": "2"}], "extra_args": ["--tp=2"]},
         "h.ddtree.server.extra_args: --tp 2 does not match slot 1's 1 GPU(s) (2)"),
        ({"slots": [{"gpus": "0,x"}]}, 'h.ddtree.server.slots[0].gpus: expected GPU indices like "0,1"'),
        ({"slots": [{"gpus": "0,0"}]}, "h.ddtree.server.slots[0].gpus: expected GPU indices"),
        ({"slots": [{"port": 30001}]}, "h.ddtree.server.slots[0].gpus: missing"),
        ({"slots": {"count": 2, "gpu_per_slot": 1}},
         "h.ddtree.server.slots.gpu_per_slot: unknown key (did you mean 'gpus_per_slot'?"),
        ({"slots": {"count": 0, "gpus_per_slot": 1}}, "h.ddtree.server.slots.count: expected a positive integer"),
        ({"slots": {"count": 2}}, "h.ddtree.server.slots: a count needs both count and gpus_per_slot"),
        ({"slots": []}, "h.ddtree.server.slots: expected {count: N, gpus_per_slot: G} or a list"),
        ({"slots": {"count": 2, "gpus_per_slot": 1}, "env": {"CUDA_VISIBLE_DEVICES": "0"}},
         "h.ddtree.server.env: CUDA_VISIBLE_DEVICES is set by each slot from its gpus"),
    ],
)
def test_bad_slots_are_one_line_naming_file_and_key(tmp_path: Path, server: dict[str, Any], message: str) -> None:
    path = write(tmp_path, server)
    with pytest.raises(InventoryError) as info:
        load_inventory([path])
    text = str(info.value)
    assert text.startswith(f"{path}: all.hosts.h.ddtree.server") and "\n" not in text
    assert message in text


def test_an_error_names_the_file_that_wrote_the_key(tmp_path: Path) -> None:
    # Slots from group_vars, the --tp-size from the inventory: each key's own file.
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "all.yml").write_text(yaml.safe_dump(
        {"ddtree": {"server": {"slots": [{"gpus": "0"}, {"gpus": "0"}]}}}
    ))
    path = write(tmp_path, {"extra_args": ["--tp-size", "1"]})
    with pytest.raises(InventoryError, match=r"group_vars/all\.yml: ddtree\.server\.slots: GPU 0 is in slot 0"):
        load_inventory([path])


def facts(count: int, *, counted: bool = True) -> HostFacts:
    gpu = GpuInfo(name="NVIDIA B300", driver_version="580", memory_total="288 GiB", compute_cap="10.3")
    return HostFacts(host="h", reachable=True, gpus=(gpu,) * count, gpus_counted=counted)


def test_doctor_fails_slots_naming_gpus_the_host_does_not_have(tmp_path: Path) -> None:
    host = load_inventory([write(tmp_path, {"slots": {"count": 4, "gpus_per_slot": 2}})]).hosts["h"]
    assert slot_gpu_problem(host, facts(8)) is None
    problem = slot_gpu_problem(host, facts(4))
    assert problem is not None and problem.startswith(
        "ddtree.server.slots: slot 2 uses GPU 4 but nvidia-smi on h lists GPUs 0-3"
    )
    # Nothing counted the GPUs (no nvidia-smi: the simulator's hosts): not a failure.
    assert slot_gpu_problem(host, facts(0, counted=False)) is None
