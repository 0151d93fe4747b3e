"""Images: the base images an account's sandboxes start from, built from a Dockerfile or imported from an OCI or
docker archive (issue 32).

- ``catalog``: :class:`~sbx.control.images.catalog.Images`, the ``images`` table, names per account (and shared
  ones the admin makes), the node that holds each image, and what a create needs to know of one.

The node builds and stores the image files (:mod:`sbx.node.images`); this room keeps what they are called and who
may use them. It reaches the plane through :class:`~sbx.control.images.catalog.ImagesPlane`. May import
:mod:`sbx.control.store`, :mod:`sbx.control.errors` and :mod:`sbx.node` types; not :mod:`sbx.control.accounts`
nor any room above.
"""
