"""Command-line entry points: parse flags, build a config, serve. No logic.

(Not a top-level ``cmd`` package as the design card drew it: that name is a
standard-library module, and shadowing it breaks ``pdb``.)
"""
