"""Frontend: spec text to a checked AST. It owns the grammar (``grammar.lark``),
the parser with located errors (``file:line:col``, the line, a caret and what
was expected), the semantic checks of names, indices and sides (``check``), the
canonical printer, and finding spec files (``specs``: a path or a shipped
name). Nothing here knows about tensors; the IR takes the AST it produces."""
