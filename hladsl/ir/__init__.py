"""IR: everything derived from a spec's state algebra, as immutable values. It
owns lowering an AST to the algebra (``lower``), the derivations (``combine``:
combine, serial update, VJP; ``chains``: chain normal form; ``chunk``: the
chunk program of contraction plans; ``symmetric``: packed symmetric states;
``scan``: which state-pass terms a chunk scan takes from chunk summaries; ``recursion``:
a derived carry's own recursion over chunks, proved),
the checks (associativity, symmetry, VJP), the closed set of operand kinds
(``operands``), and the listed pass pipeline with a verifier per pass
(``pipeline``). It reads no files and formats no CLI text."""
