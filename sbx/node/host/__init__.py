"""The host a node runs on: preparing it (``sbx setup``), checking it (``sbx doctor``) and the base image.

- :mod:`sbx.node.host.setup`: ``sbx setup`` and ``sbx doctor``;
- :mod:`sbx.node.host.criuinstall`: the CRIU that ``sbx setup`` installs beside the host's packages;
- :mod:`sbx.node.host.aptsources`: the host's apt sources (the Debian mirror the other steps use);
- :mod:`sbx.node.host.image`: the sandboxes' base image, built once per recipe;
- :mod:`sbx.node.host.limits`: the kernel limits many sandboxes need;
- :mod:`sbx.node.host.tools`: running a host tool and turning its failure into an error.

May import :mod:`sbx.node.container`, :mod:`sbx.node.types`, :mod:`sbx.config`, the image recipe
(:mod:`sbx.guest.recipe`) and the layers below the node (runtime, storage), not :mod:`sbx.node.network`.
"""
