"""Stand-ins for DCGM's `dcgmi` and linuxptp's `pmc`, for hosts that have neither (this one, CI).

Each is a real executable (a Python script) put in a folder that a test prepends to PATH or
names in the collector's own executable argument: the collectors run it as a child process
and parse its output, exactly as they would the real tool's. They print what the real tools
print, in the format DCGM and linuxptp document (the same samples the parser tests use), and
read a JSON state file beside them, so a test can change the GPUs' utilisation, take the host
engine away or point it elsewhere while a collector (or a node daemon) runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DCGMI = r"""
import json, sys
from pathlib import Path
state = json.loads((Path(__file__).parent / "dcgm.json").read_text())
args = sys.argv[1:]
host = args[args.index("--host") + 1] if "--host" in args else "localhost"
if not state["up"] or host != state["host"]:
    print(f"Error: unable to establish a connection to the specified host: {host}")
    print("Error: Unable to connect to host engine. Host engine connection invalid/disconnected.")
    sys.exit(1)
if args[0] == "dmon":
    print("#Entity   GPUTL  XIDER")
    print("ID")
    for i, util in enumerate(state["utilisation"]):
        print(f"GPU {i}     {util}     {state['xid'][i]}")
elif args[0] == "health":
    print("+---------------------------+-------------------------------------------+")
    print("| Health Monitor Report                                                 |")
    print("+===========================+===========================================+")
    print("| Overall Health            | Healthy                                   |")
    print("+---------------------------+-------------------------------------------+")
else:
    sys.exit(2)
"""

PMC = r"""
import json, sys
from pathlib import Path
state = json.loads((Path(__file__).parent / "ptp.json").read_text())
args = sys.argv[1:]
socket = args[args.index("-s") + 1] if "-s" in args else "/var/run/ptp4l"
print("sending: GET TIME_STATUS_NP")
if state["up"] and socket == state["socket"] and args[-1] == "GET TIME_STATUS_NP":
    print("\t90e2ba.fffe.20c7f8-0 seq 0 RESPONSE MANAGEMENT TIME_STATUS_NP")
    print(f"\t\tmaster_offset              {state['offset_ns']}")
    print("\t\tingress_time               1453386409735441914")
    print("\t\tgmPresent                  true")
    print("\t\tgmIdentity                 001b21.fffe.6fa06b")
"""


def _script(folder: Path, name: str, body: str, state_name: str, state: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    (folder / state_name).write_text(json.dumps(state))
    return path


def fake_dcgmi(
    folder: Path, utilisation: list[int], host: str = "127.0.0.1", up: bool = True
) -> Path:
    """`folder/dcgmi`, a host engine at `host` (the `--host` it answers) whose GPUs show these
    utilisations in percent; `set_dcgm(folder, ...)` changes that while it runs."""
    state = {"utilisation": utilisation, "xid": [0] * len(utilisation), "host": host, "up": up}
    return _script(folder, "dcgmi", DCGMI, "dcgm.json", state)


def set_dcgm(folder: Path, **changes: Any) -> None:
    path = folder / "dcgm.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def fake_pmc(
    folder: Path, offset_ns: int = -1327, socket: str = "/var/run/ptp4l", up: bool = True
) -> Path:
    """`folder/pmc`, with a ptp4l answering on `socket` `offset_ns` from its grandmaster
    (or, with `up=False`, none: pmc then prints only its request, as the real one does)."""
    state = {"offset_ns": offset_ns, "socket": socket, "up": up}
    return _script(folder, "pmc", PMC, "ptp.json", state)
