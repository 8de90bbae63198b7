/* wsync_trainer_client.h from C: the header compiles as C99, the library links from C, and calls
 * without an agent fail with the documented codes and a message that says what to do. */
#define _DEFAULT_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "wsync_trainer_client.h"

static int failures = 0;
#define EXPECT(cond)                                                  \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: EXPECT(%s) failed\n", __FILE__, __LINE__, #cond); \
      failures++;                                                     \
    }                                                                 \
  } while (0)

int main(void) {
  char dir[] = "/tmp/wsync-c-test-XXXXXX";
  wsync_client* c = (wsync_client*)1;
  int64_t shape[2] = {4, 8};
  EXPECT(mkdtemp(dir) != NULL);
  setenv("WSYNC_RUNTIME_DIR", dir, 1);
  EXPECT(wsync_client_abi_version() == WSYNC_CLIENT_ABI_VERSION);

  EXPECT(wsync_client_open("bad/name", 0, 0, &c) == WSYNC_INVALID_ARGUMENT);
  EXPECT(c == NULL);
  EXPECT(strstr(wsync_last_error(), "bad source name") != NULL);
  EXPECT(wsync_client_open("job", -1, 0, &c) == WSYNC_INVALID_ARGUMENT);
  EXPECT(wsync_client_open("job", 0, 0, NULL) == WSYNC_INVALID_ARGUMENT);

  /* Nobody serves the socket: UNAVAILABLE after the timeout, naming the agent flag to use. */
  EXPECT(wsync_client_open("job", 3, 150, &c) == WSYNC_UNAVAILABLE);
  EXPECT(strstr(wsync_last_error(), "--source shm:job") != NULL);
  EXPECT(strstr(wsync_last_error(), "job.r00003.sock") != NULL);

  /* NULL clients are refused, close(NULL) is a no-op. */
  EXPECT(wsync_client_add_tensor(NULL, "w", "BF16", shape, 2) == WSYNC_INVALID_ARGUMENT);
  EXPECT(wsync_client_register(NULL, "{}", "{}", 0) == WSYNC_INVALID_ARGUMENT);
  EXPECT(wsync_client_begin_update(NULL, 0) == WSYNC_INVALID_ARGUMENT);
  EXPECT(wsync_client_request_sync(NULL, 1, 1, 0, NULL) == WSYNC_INVALID_ARGUMENT);
  EXPECT(wsync_client_tensor(NULL, "w", NULL) == NULL);
  wsync_client_close(NULL);
  rmdir(dir);
  if (failures) return 1;
  printf("trainer client C API: ok\n");
  return 0;
}
