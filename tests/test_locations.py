"""Locations named as the user knows them (nan_magic/locations.py)."""

from __future__ import annotations

import os

from nan_magic.locations import name_location
from nan_magic.records import SourcePointer


def test_a_file_under_the_working_directory_is_named_relative_to_it(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "models" / "net.py")
    assert name_location(path, 14) == os.path.join("models", "net.py") + ":14"
    assert str(SourcePointer(path, 14, "forward")) == os.path.join("models", "net.py") + ":14, in forward"


def test_a_file_elsewhere_keeps_its_absolute_path_and_pseudo_files_their_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert name_location("/elsewhere/net.py", 3) == "/elsewhere/net.py:3"
    assert name_location("<string>", 3) == "<string>:3"


def test_a_cell_is_named_as_ipython_names_it(ip) -> None:
    filename = ip.compile.cache("y = 1\n", 7)
    assert name_location(filename, 1) == "Cell In[7], line 1"
