"""Frontend: spec text -> checked AST (grammar.lark, parser, checks, printer)."""
