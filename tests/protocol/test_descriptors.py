"""The open-files limit both sides raise (protocol/descriptors.py), checked in a fresh process: the limit is the
process's own, so this one's is never changed."""

import resource
import subprocess
import sys
import textwrap

import pytest


def test_the_soft_limit_rises_to_the_hard_one_only_when_short_and_a_low_hard_limit_is_named():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 600:
        pytest.skip(f"the hard limit on open files is {hard}")
    code = textwrap.dedent("""
        import errno, resource
        from stoker.protocol.descriptors import raise_open_files_limit
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        hard = 4096 if hard == resource.RLIM_INFINITY else hard  # a soft limit cannot be raised to infinity
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        raise_open_files_limit(200, "w", "x")
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (300, hard), "raised though enough"
        raise_open_files_limit(400, "w", "x")
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard), "not raised though short"
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 500))
        try:
            raise_open_files_limit(600, "9 producer connections", "connect this trainer to fewer producers")
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
            assert str(exc).endswith("9 producer connections need about 600 open files but this process may open "
                                     "at most 500: raise the limit (ulimit -n 600, or LimitNOFILE= in a systemd "
                                     "unit) or connect this trainer to fewer producers"), exc
        else:
            raise AssertionError("no OSError past the hard limit")
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (300, 500), "changed though refused"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
