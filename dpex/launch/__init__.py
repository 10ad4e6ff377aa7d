"""Where the daemons run: local processes (local.py) or Ray actors (ray.py);
launchers start the CLIs with flags and hold no logic of their own."""
