"""Checkpoint state that does not depend on the layout that wrote it.

format.py names the files and the records; reader.py reads them back without a process group
(for a resume on another layout and for `dsforge export`). The rank side that writes and
installs the state lives in dsforge/runtime/checkpoint/layout_free.py.
"""
