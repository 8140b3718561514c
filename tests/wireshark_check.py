"""Compare the Lua dissector's fields (tshark) with analysis.pcap's table, packet by packet."""

import shutil
import subprocess

import numpy as np
import pandas as pd

from trimlab import wire
from trimlab.analysis import pcap, wireshark

FIELDS = [name for name, _ in wire.HEADER_FIELDS]


def tshark_table(path) -> pd.DataFrame:
    cols = ["frame.number", *(f"trimlab.{f}" for f in FIELDS), "trimlab.received", "trimlab.trimmed",
            "trimlab.bits_per_coord", "udp.length"]
    out = subprocess.run([shutil.which("tshark"), "-n", "-X", f"lua_script:{wireshark.plugin_path()}", "-r", str(path),
                          "-T", "fields", "-E", "separator=,", "-E", "occurrence=f", *(x for c in cols for x in ("-e", c))],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split(",") for line in out.splitlines()]
    return pd.DataFrame(rows, columns=cols)


def assert_dissector_matches(path) -> int:
    """Every packet: trimlab fields where the table has a trimlab header, none elsewhere
    on the gradient port; trimmed / received / bits derived from the lengths. Returns the
    number of trimlab packets compared."""
    ours = pcap.read(path)
    ts = tshark_table(path)
    assert len(ts) == len(ours)
    has = ts["trimlab.magic"] != ""
    on_port = ((ours["dport"] == 47000) | (ours["sport"] == 47000)).to_numpy()
    # on the gradient port, exactly the packets our reader takes for trimlab (elsewhere the
    # dissector's heuristic may find more)
    assert (has.to_numpy()[on_port] == ours["trimlab"].to_numpy()[on_port]).all()
    rows = ours["trimlab"].to_numpy()
    assert has.to_numpy()[rows].all()
    t, o = ts[rows], ours[rows]
    for name in FIELDS:
        got = t[f"trimlab.{name}"]
        if name == "scale":
            assert np.allclose(got.astype(float), o["scale"].astype(float), rtol=1e-5, atol=0), name
        else:
            assert (got.map(lambda v: int(v, 0)).to_numpy() == o[name].to_numpy()).all(), name
    received = o["udp_payload"].to_numpy()  # the frame's: a real switch leaves udp.length stale
    assert (t["trimlab.received"].astype(int).to_numpy() == received).all()
    assert (t["trimlab.trimmed"].astype(int).to_numpy() == (received < o["length"].to_numpy())).all()
    bits = 8.0 * (received - wire.HEADER_LEN) / o["coords"].to_numpy()
    assert np.allclose(t["trimlab.bits_per_coord"].astype(float).to_numpy(), bits)
    return int(rows.sum())
