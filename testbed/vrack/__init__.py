"""The virtual rack: namespaces, management network, sshd, the eBPF trimming switch."""
