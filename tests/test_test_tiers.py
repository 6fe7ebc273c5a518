"""The parallel run's grouping (tests/conftest.py): under pytest-xdist every test carries its
file's group in its node id, which is how --dist=loadgroup keeps a file on one worker. When the
group does not arrive (pytest 9.2 with pytest-xdist 3.8: pyproject pins pytest below 9.2), the
grouping is silently off and files that watch the same engine processes run side by side."""
import os


def test_under_xdist_a_test_carries_its_files_group(request):
    if "PYTEST_XDIST_WORKER" in os.environ:
        assert request.node.nodeid.endswith("@test_test_tiers.py"), request.node.nodeid
    else:  # one process: no groups, the files' own order
        assert "@" not in request.node.nodeid, request.node.nodeid
