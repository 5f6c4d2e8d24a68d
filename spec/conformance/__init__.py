"""The conformance kit: the suite's properties, shipped with the package, against any speculative decoder.

    python -m spec conform --impl NAME [--budget B]        # a table and conformance.json
    pytest --pyargs spec.conformance --impl NAME            # plain pytest, one test per property and case

The pytest side is a plugin (spec/conformance/plugin.py, registered through the `pytest11` entry
point) that adds --impl and --conform-budget and the `impl` and `budget` fixtures; the properties
are the test_*.py modules next to it; kit.py holds the models, references and evidence they share.
Nothing here reads the source checkout's tests/ folder.
"""
