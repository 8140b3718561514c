"""The Lua dissector under tshark, on a capture with untrimmed and trimmed gradient
packets (IPv4 and IPv6, the default port and another) and the reliable channel; the
`trimlab wireshark` commands."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scapy.all import IP, UDP, Ether, IPv6, Raw, wrpcap

from tests.wireshark_check import assert_dissector_matches
from trimlab import wire
from trimlab.agents.reliable import ACK, CTRL, CTRL_VERSION, PARAMS
from trimlab.analysis import pcap, wireshark
from trimlab.codec import get_codec

MAC = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")  # no address lookups
TRIMLAB = str(Path(sys.executable).with_name("trimlab"))
pytestmark = pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark missing (make setup installs it)")


def capture(path: Path) -> Path:
    """Gradient packets of four codecs, every other one trimmed, then two control messages."""
    pk = []
    for i, name in enumerate(["embedded", "sign_tail", "fp32", "bf16"]):
        p = wire.packetize(torch.randn(3000), get_codec(name), coords=256, ids=wire.PacketIds(3, 7 + i, i, 2))
        for j, payload in enumerate(p):
            cut = payload if j % 2 else payload[:wire.HEADER_LEN + 8 * j]
            l3 = (IPv6(src="fd00:7472::11", dst="fd00:7472::12", tc=40) if i % 2
                  else IP(src="198.19.0.11", dst="198.19.0.12", tos=40 if j % 2 else 44))
            pk.append(MAC / l3 / UDP(sport=40000, dport=47000) / Raw(cut))
    chunk = CTRL.pack(PARAMS, CTRL_VERSION, 3, 7, 0, 1, 4) + b"\0" * 64
    ack = CTRL.pack(ACK, CTRL_VERSION, 3, 7, 0, 0, 4) + bytes([0b1011])
    pk += [MAC / IP(src="198.19.0.12", dst="198.19.0.11") / UDP(sport=47001, dport=47001) / Raw(x)
           for x in (chunk, ack)]
    wrpcap(str(path), pk)
    return path


def tshark(path: Path, *args: str) -> str:
    return subprocess.run(["tshark", "-n", "-X", f"lua_script:{wireshark.plugin_path()}", "-r", str(path), *args],
                          capture_output=True, text=True, check=True).stdout


def test_every_field_matches_the_pcap_table(tmp_path):
    path = capture(tmp_path / "t.pcap")
    assert assert_dissector_matches(path) == len(pcap.read(path)) - 2  # all but the control messages
    info = tshark(path, "-Y", "trimlab.trimmed == 1", "-T", "fields", "-e", "_ws.expert.message",
                  "-e", "trimlab.codec")
    first = info.splitlines()[0].split("\t")
    assert first[0] == f"trimmed: sent {wire.HEADER_LEN + 512} bytes, 24 arrived" and first[1] == "4"
    names = tshark(path, "-Y", "trimlab", "-V")
    assert {f"Codec: {c}" for c in ("embedded (4)", "sign_tail (3)", "fp32 (1)", "bf16 (2)")} <= \
        {line.split("= ")[-1].strip() for line in names.splitlines()}


def test_the_reliable_channel_is_dissected(tmp_path):
    out = tshark(capture(tmp_path / "t.pcap"), "-Y", "trimlab_ctrl", "-T", "fields", "-e", "trimlab_ctrl.kind",
                 "-e", "trimlab_ctrl.step", "-e", "trimlab_ctrl.first", "-e", "trimlab_ctrl.count",
                 "-e", "trimlab_ctrl.acked")
    assert [line.split("\t") for line in out.splitlines()] == [["1", "7", "1", "4", ""], ["2", "7", "0", "4", "3"]]


def test_heuristic_finds_trimlab_on_another_port(tmp_path):
    p = wire.packetize(torch.randn(600), get_codec("embedded"), coords=480)[0]
    wrpcap(str(tmp_path / "o.pcap"), [MAC / IP() / UDP(sport=1, dport=50000) / Raw(p),
                                      MAC / IP() / UDP(sport=1, dport=50000) / Raw(b"\xa1" + bytes(40))])
    out = tshark(tmp_path / "o.pcap", "-T", "fields", "-e", "trimlab.coords")
    assert out.splitlines() == ["480", ""]  # the second claims a length shorter than it is


def test_path_and_install_commands(tmp_path):
    path = subprocess.run([TRIMLAB, "wireshark", "path"], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(path) == wireshark.plugin_path() and Path(path).read_text().startswith("-- Wireshark")
    out = subprocess.run([TRIMLAB, "wireshark", "install", "--dir", str(tmp_path / "plugins")],
                         capture_output=True, text=True, check=True).stdout
    assert (tmp_path / "plugins" / "trimlab.lua").read_bytes() == Path(path).read_bytes() and "installed" in out
    # the default folder is the one tshark names
    assert wireshark.personal_plugin_dir().name == "plugins"
