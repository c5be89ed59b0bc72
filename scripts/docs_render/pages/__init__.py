"""One module a page: the figures whose home is that page (their commands, collectors and views)."""
