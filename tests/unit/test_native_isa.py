"""The native libraries are built for a vector level the running CPU supports, chosen from
its feature flags (injected here, so every kind of CPU is covered on any host), and a
library built for another CPU is never loaded: not from a cache shared between hosts, not
when TRIMLAB_ISA asks for more than the CPU has."""

import ctypes
import shutil

import pytest

from trimlab import native, resources
from trimlab.agents import rx
from trimlab.codec import kernels as codec_kernels

V4 = native.ISAS["avx512"].needs
AVX2_ONLY = native.ISAS["avx2"].needs | {"fpu", "sse", "sse2", "aes", "sha_ni"}  # an AMD EPYC Zen 2/3
SKYLAKE_X = V4 | {"fpu", "sse2"}  # AVX-512 without GFNI and VBMI
ICELAKE = V4 | {"gfni", "avx512vbmi", "avx512_vnni"}


def _names(levels):
    return [isa.name for isa in levels]


@pytest.mark.unit
@pytest.mark.parametrize("features,machine,want", [
    (ICELAKE, "x86_64", ["avx512-gfni", "avx512", "avx2", "plain"]),
    (SKYLAKE_X, "x86_64", ["avx512", "avx2", "plain"]),
    (AVX2_ONLY, "x86_64", ["avx2", "plain"]),
    (AVX2_ONLY - {"fma"}, "x86_64", ["plain"]),  # AVX2 without FMA (x86-64-v3 needs both)
    (frozenset({"fpu", "sse2"}), "x86_64", ["plain"]),
    (ICELAKE, "aarch64", ["plain"]),  # x86 names mean nothing on another machine
    (frozenset({"fp", "asimd"}), "aarch64", ["plain"]),
])
def test_the_levels_a_cpu_runs_follow_its_feature_flags(features, machine, want):
    assert _names(native.runnable(frozenset(features), machine)) == want
    assert native.choose(frozenset(features), machine, cap="").name == want[0]


@pytest.mark.unit
def test_a_cap_picks_a_lower_level_and_refuses_one_the_cpu_lacks():
    assert native.choose(ICELAKE, "x86_64", cap="avx2").name == "avx2"
    assert native.choose(AVX2_ONLY, "x86_64", cap="plain").name == "plain"
    with pytest.raises(native.IsaError, match=r"TRIMLAB_ISA=avx512: this CPU cannot run it \(it runs avx2, plain\)"):
        native.choose(AVX2_ONLY, "x86_64", cap="avx512")
    with pytest.raises(native.IsaError, match="TRIMLAB_ISA='sse9': choose one of"):
        native.choose(AVX2_ONLY, "x86_64", cap="sse9")


@pytest.mark.unit
def test_a_level_the_cpu_lacks_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIMLAB_CACHE", str(tmp_path))
    src = resources.c_source("codec", "kernels.c")
    with pytest.raises(native.IsaError, match="needs CPU features this host lacks: avx512bw avx512cd"):
        native.load_library(src, "codec", codec_kernels.FLAGS, native.ISAS["avx512"], features=AVX2_ONLY)
    assert not list(tmp_path.glob("codec-*"))


@pytest.mark.unit
@pytest.mark.parametrize("source,name,flags", [(("codec", "kernels.c"), "codec", codec_kernels.FLAGS),
                                               (("agents", "rx.c"), "rx", rx.FLAGS)])
def test_a_cache_shared_with_a_bigger_cpu_never_hands_over_its_library(tmp_path, monkeypatch, source, name, flags):
    """Host A (AVX-512 with GFNI) builds into a shared cache; host B (AVX2 only) gets a
    library of its own level. Even when A's library sits at the path of B's level (a cache
    copied by hand), B's loader sees the stamp, rebuilds, and never loads A's."""
    monkeypatch.setenv("TRIMLAB_CACHE", str(tmp_path))
    src = resources.c_source(*source)
    big = native.build_library(src, name, flags, native.ISAS["avx512-gfni"])  # compiling runs nothing
    assert native.built_for(big) == "avx512-gfni" and "avx512-gfni" in big.name

    loaded = []
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **kw: loaded.append(str(path)) or real_cdll(path, *a, **kw))
    lib, isa = native.load_library(src, name, flags, features=AVX2_ONLY)
    assert isa.name == "avx2" and loaded and native.built_for(tmp_path / loaded[-1]) == "avx2"
    assert str(big) not in loaded

    small = tmp_path / loaded[-1]
    wrong = small.with_name("wrong.tmp")
    shutil.copyfile(big, wrong)
    wrong.replace(small)  # the wrong library under the right name (a new file: the loaded one stays mapped)
    native.load_library(src, name, flags, features=AVX2_ONLY)
    assert native.built_for(small) == "avx2" and str(big) not in loaded


@pytest.mark.unit
def test_the_codec_reports_the_path_it_runs(monkeypatch):
    best = native.runnable()[0]
    monkeypatch.delenv("TRIMLAB_ISA", raising=False)
    assert codec_kernels.isa() == best
    monkeypatch.setenv("TRIMLAB_ISA", "plain")
    assert codec_kernels.isa().name == "plain"
    monkeypatch.setenv("TRIMLAB_ISA", "sse9")
    with pytest.raises(native.IsaError):  # an error, not a silent fall-back to torch
        codec_kernels.available()


@pytest.mark.unit
def test_features_can_be_taken_away_to_rehearse_a_smaller_cpu(monkeypatch):
    """TRIMLAB_CPU_FEATURES_OFF=avx512f makes this host choose as an AVX2-only one would;
    it can only remove features, never claim one the CPU lacks."""
    real = native._cpu_flags()  # what /proc/cpuinfo says
    monkeypatch.setenv("TRIMLAB_CPU_FEATURES_OFF", "avx512f, gfni")
    assert native.host_features() == real - {"avx512f", "gfni"}
    assert not any(isa.name.startswith("avx512") for isa in native.runnable())
    monkeypatch.setenv("TRIMLAB_CPU_FEATURES_OFF", "")
    assert native.host_features() == real
