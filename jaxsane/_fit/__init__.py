"""_fit: see the package map in jaxsane/__init__.py."""
