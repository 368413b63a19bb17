"""The fuzzing suite of every input surface (docs/fuzzing.md): hypothesis draws small hostile edits of
valid inputs, each case runs in a memory- and time-limited child, and a case passes only with the
correct result or one typed error line. ``tools/fuzz.py`` is the long runner; tests/test_fuzz the CI run."""
