/* Prints the parent's pid through libwrap.so's getppid wrapper. */
#include <stdio.h>
#include <unistd.h>

int main(void) {
  printf("ppid %d\n", (int)getppid());
  return 0;
}
