"""The SSH gateway (issue 35): ``ssh -p 2222 <sandbox id>@HOST`` reaches the sandbox's own sshd, so ssh, scp, sftp,
rsync, port forwarding and VS Code Remote-SSH work. ``server`` (the listener, the way to a sandbox's sshd), ``auth``
(who may log in, the gateway's keys), ``relay`` (sessions between the two connections)."""

from sbx.api.sshgateway.server import SshGateway

__all__ = ["SshGateway"]
