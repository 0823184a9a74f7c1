"""Code shared by the bench/ scripts, which run with bench/ on sys.path: `from lib import ...`."""
