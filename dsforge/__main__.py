from dsforge.cli import entry

entry()
