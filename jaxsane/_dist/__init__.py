"""_dist: see the package map in jaxsane/__init__.py."""
