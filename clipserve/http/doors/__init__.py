"""One module per API family; each bundles its routes, parsing, encoding and error shape."""
