// UDP load generator for `trimlab bench switch`: sendmmsg in batches of 64 from one
// socket, for a fixed time. Usage: blast DST PORT PAYLOAD_BYTES TOS SECONDS
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: %s DST PORT PAYLOAD_BYTES TOS SECONDS\n", argv[0]);
		return 2;
	}
	int v6 = strchr(argv[1], ':') != NULL, port = atoi(argv[2]), size = atoi(argv[3]);
	int tos = atoi(argv[4]);
	double seconds = atof(argv[5]);
	struct sockaddr_storage dst = {0};
	socklen_t dlen;
	int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_DGRAM, 0);
	if (v6) {
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)&dst;
		a->sin6_family = AF_INET6;
		a->sin6_port = htons(port);
		inet_pton(AF_INET6, argv[1], &a->sin6_addr);
		dlen = sizeof(*a);
		setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, sizeof(tos));
	} else {
		struct sockaddr_in *a = (struct sockaddr_in *)&dst;
		a->sin_family = AF_INET;
		a->sin_port = htons(port);
		inet_pton(AF_INET, argv[1], &a->sin_addr);
		dlen = sizeof(*a);
		setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof(tos));
	}
	if (fd < 0 || connect(fd, (struct sockaddr *)&dst, dlen) < 0) {
		perror("socket/connect");
		return 1;
	}
	char *buf = calloc(1, size);
	struct iovec iov = {buf, size};
	struct mmsghdr msgs[64];
	memset(msgs, 0, sizeof(msgs));
	for (int i = 0; i < 64; i++) {
		msgs[i].msg_hdr.msg_iov = &iov;
		msgs[i].msg_hdr.msg_iovlen = 1;
	}
	long sent = 0;
	double end = now() + seconds;
	while (now() < end) {
		int n = sendmmsg(fd, msgs, 64, 0);
		if (n > 0)
			sent += n;
	}
	printf("%ld\n", sent);
	return 0;
}
