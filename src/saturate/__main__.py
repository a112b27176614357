from saturate.cli import entry

entry()
